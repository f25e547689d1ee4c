"""OpenCL backend speed, per kernel family: GEMV GB/s per weight type (one token, and batches of
decodes), GEMM GFLOP/s, decode attention GB/s, launch overhead, and per model: prompt-processing /
generation tokens/s, launches per layer and host time per decode step (next to the CPU backend).

    python bench/opencl_bench.py [--device opencl] [--kernels cpu,gpu] [--model PATH ...]
                                 [--no-model | --no-kernels] [--only SECTIONS] [--types TYPES]
                                 [--no-cpu-baseline] [--quick]
                                 [--peak-gbs X] [--peak-gflops Y] [--json | --json-out FILE]

Kernel figures come from OpenCL profiling events (device time of the launches alone); the "wall"
figures include enqueueing. Weights are packed as the model loader packs them (pack_weight: the gpu
family's flat rows). With --peak-gbs / --peak-gflops (the device's memory bandwidth and f32 peak)
every figure also says how close to that roof it is. On a CPU device shared with other work, the
device time counts the time pocl's threads wait for a core, so each kernel row also gives a "per
busy core" rate: work done per second of CPU time this process used, times the compute units.
pocl targets (shared/design/performance.md): GEMV >= 20 GB/s of weight bytes, f32 GEMM >= 40
GFLOP/s.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import time
from types import SimpleNamespace

# numpy's bundled OpenBLAS keeps its threads spinning after a call, taking cores from pocl's.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import numpy as np  # noqa: E402

from ferrum import _core  # noqa: E402

GEMV_TARGET_GBS = 20.0
GEMM_TARGET_GFLOPS = 40.0
WEIGHT_BYTES = 96 << 20  # bigger than the last-level cache, so GEMV streams from DRAM
ALL_GEMV_TYPES = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k",
                  "q6_k", "iq4_nl", "iq4_xs"]
QUICK_GEMV_TYPES = ["f16", "q8_0", "q4_1", "q4_k"]


def random_weight(be, dtype: str, n: int, k: int, rng):
    """A [n, k] weight tensor in dtype, packed as a loader packs it: 64 distinct quantized rows
    tiled (quantizing ~100 MB of floats would dominate the run), plus its byte size."""
    base = rng.standard_normal((64, k)).astype(np.float32)
    if dtype == "f32":
        rows = base
    elif dtype == "f16":
        rows = base.astype(np.float16)
    else:
        rows = np.stack([_core.quant.quantize(dtype, r) for r in base])
    data = np.ascontiguousarray(np.tile(rows, (n // 64 + 1, 1))[:n])
    w = be.tensor(data) if dtype in ("f32", "f16") else be.tensor_raw(data.reshape(-1), dtype, [n, k])
    return be.pack_weight(w), data.nbytes


def device_seconds(stream, reps: int) -> float:
    """Median device time of one submit of `stream`, from profiling events."""
    _core.opencl.set_profiling(stream, True)
    times = []
    for _ in range(reps):
        stream.submit()
        stream.sync()
        times.append(sum(ns for _, ns in _core.opencl.kernel_times(stream)) * 1e-9)
    _core.opencl.set_profiling(stream, False)
    return statistics.median(times)


def cpu_seconds(stream, reps: int) -> float:
    """CPU time (all threads of this process) of one submit of `stream`."""
    stream.submit()
    stream.sync()
    c0 = time.process_time()
    for _ in range(reps):
        stream.submit()
    stream.sync()
    return (time.process_time() - c0) / reps


def wall_seconds(stream, reps: int) -> float:
    stream.submit()
    stream.sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        stream.submit()
    stream.sync()
    return (time.perf_counter() - t0) / reps


class Rates:
    """Turns (bytes, flops, stream) into the report's rate fields."""

    def __init__(self, be, reps: int, peak_gbs: float | None, peak_gflops: float | None):
        info = _core.opencl.device_info(be)
        self.reps, self.gpu, self.cu = reps, info["gpu"], info["compute_units"]
        self.peak_gbs, self.peak_gflops = peak_gbs, peak_gflops

    def measure(self, stream, nbytes: float, flop: float) -> dict:
        dev = device_seconds(stream, self.reps)
        r = dict(device_ms=round(dev * 1e3, 4), wall_ms=round(wall_seconds(stream, self.reps) * 1e3, 4),
                 gb_s=round(nbytes / dev / 1e9, 2), gflop_s=round(flop / dev / 1e9, 2))
        if self.peak_gbs:
            r["pct_peak_bw"] = round(100 * r["gb_s"] / self.peak_gbs, 1)
        if self.peak_gflops:
            r["pct_peak_flops"] = round(100 * r["gflop_s"] / self.peak_gflops, 1)
        if not self.gpu:
            busy = cpu_seconds(stream, self.reps) / self.cu
            r["gb_s_busy"], r["gflop_s_busy"] = round(nbytes / busy / 1e9, 2), round(flop / busy / 1e9, 2)
        return r


def bench_linear(be, rates, dtype: str, tokens: int, k: int, n: int | None, rng, decode_rows: int = 0):
    """linear over `tokens` rows; decode_rows > 0: a batch of decodes (8-bit activations)."""
    if n is None:
        row_bytes = k * 4 if dtype == "f32" else k * 2 if dtype in ("f16", "bf16") else \
            len(_core.quant.quantize(dtype, np.zeros(k, np.float32)))
        n = max(64, WEIGHT_BYTES // row_bytes)
    w, nbytes = random_weight(be, dtype, n, k, rng)
    x = be.tensor(rng.standard_normal((tokens, k)).astype(np.float32))
    out = be.empty("f32", [tokens, n])
    s = be.stream()
    s.decode_rows = decode_rows
    be.linear(x, w, None, out, stream=s)
    return dict(dtype=dtype, tokens=tokens, k=k, n=n, weight_mib=round(nbytes / 2**20, 1),
                launches=len(s), **rates.measure(s, nbytes, 2.0 * tokens * n * k))


def bench_decode_attention(be, rates, positions: int, heads=32, kv_heads=8, head_dim=128, tokens=1):
    """paged_attention of `tokens` decodes each over `positions` positions of an f16 pool (one
    sequence each): GB/s of K and V read."""
    bs = 16
    blocks_per_seq = (positions + bs - 1) // bs
    shape = [tokens * blocks_per_seq, kv_heads, bs, head_dim]
    kv = _core.KvLayer(be.tensor(np.zeros(shape, np.float16)), be.tensor(np.zeros(shape, np.float16)))
    tables = np.arange(tokens * blocks_per_seq, dtype=np.int32).reshape(tokens, blocks_per_seq)
    pos = np.full(tokens, positions - 1, np.int32)
    batch = _core.AttnBatch(be.tensor(np.arange(tokens, dtype=np.int32)), be.tensor(pos), be.tensor(pos),
                            be.tensor(tables))
    q = be.tensor(np.random.default_rng(0).standard_normal((tokens, heads, head_dim)).astype(np.float32))
    out = be.empty("f32", [tokens, heads, head_dim])
    s = be.stream()
    be.paged_attention(q, kv, batch, _core.AttnParams(heads, kv_heads, head_dim, head_dim ** -0.5, 0), out, stream=s)
    nbytes = 2.0 * tokens * positions * kv_heads * head_dim * 2
    flop = 4.0 * tokens * positions * heads * head_dim
    return dict(positions=positions, tokens=tokens, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                launches=len(s), **rates.measure(s, nbytes, flop))


def launch_overhead_us(be, command_buffer: bool, launches: int = 400) -> float:
    """Wall time per launch of a stream of tiny kernels (what one decode step pays per op)."""
    gate_up = be.tensor(np.ones((1, 128), np.float32))
    out = be.empty("f32", [1, 64])
    s = be.stream()
    _core.opencl.set_command_buffer(s, command_buffer)
    for _ in range(launches):
        be.swiglu(gate_up, out, stream=s)
    return wall_seconds(s, 5) / launches * 1e6


def model_speed(model: str, device: str, n_prompt: int, n_gen: int, reps: int) -> dict:
    """`ferrum bench`'s figures (its own line of output kept out of this report's)."""
    from ferrum.bench import run_bench
    args = SimpleNamespace(model_path=model, device=device, threads=2, n_prompt=n_prompt,
                           n_gen=n_gen, repetitions=reps, json=True)
    with contextlib.redirect_stdout(io.StringIO()):
        return run_bench(args)


def decode_step_costs(model: str, device: str, steps: int = 16) -> dict:
    """Launches and host time per decode step of one sequence (a replayed recorded step), from
    the OpenCL backend's submit counters; launches per layer = per step / layers (the embedding,
    final norm and lm_head included)."""
    runner = _core.ModelRunner(model, device=device, num_threads=2, max_model_len=512, kv_cache_tokens=512)
    engine = _core.Engine(runner, max_num_seqs=1, max_num_batched_tokens=64)
    seq = engine.add_sequence(list(range(1, 33)))
    tok = int(engine.step()["logits"][0].argmax())
    for _ in range(2):  # record the decode step's stream
        engine.commit([seq], [tok], [False])
        tok = int(engine.step()["logits"][0].argmax())
    c0, t0 = _core.opencl.submit_counters(), time.perf_counter()
    for _ in range(steps):
        engine.commit([seq], [tok], [False])
        tok = int(engine.step()["logits"][0].argmax())
    wall, c1 = time.perf_counter() - t0, _core.opencl.submit_counters()
    submits = max(1, c1["submits"] - c0["submits"])
    launches = (c1["launches"] - c0["launches"]) / steps
    return dict(layers=runner.config["num_layers"], launches_per_step=round(launches, 1),
                launches_per_layer=round(launches / runner.config["num_layers"], 2),
                submits_per_step=round(submits / steps, 2),
                command_buffer=c1["command_buffer_submits"] - c0["command_buffer_submits"] == submits,
                host_submit_us_per_step=round((c1["host_seconds"] - c0["host_seconds"]) / steps * 1e6, 1),
                wall_ms_per_step=round(wall / steps * 1e3, 3))


def bench_family(args, kernels: str, rng) -> dict:
    be = _core.make_backend(args.device, opencl_kernels=kernels)
    reps = 5 if args.quick else 10
    rates = Rates(be, reps, args.peak_gbs, args.peak_gflops)
    report = {"kernels": kernels, "gemv": [], "batched_decode": [], "gemm": [], "attention": [], "models": []}
    if not args.no_kernels:
        bench_kernels(args, be, rates, report, rng)
        if kernels == "gpu":  # its sizes, and whether NVIDIA's inline PTX built (-DNV_ASM)
            report["gpu_defines"] = _core.opencl.device_info(be)["gpu_defines"]
    for model in [] if args.no_model else args.model or [None]:
        os.environ["FERRUM_OPENCL_KERNELS"] = kernels  # the runner makes its own backend
        n_prompt, n_gen = (64, 16) if args.quick else (128, 64)
        m = model_speed(model, args.device, n_prompt, n_gen, 2 if args.quick else 3)
        m.update(decode_step_costs(m["model"], args.device))
        report["models"].append(m)
        del os.environ["FERRUM_OPENCL_KERNELS"]
    return report


SECTIONS = ("gemv", "batched", "gemm", "attention", "launch")


def bench_kernels(args, be, rates, report: dict, rng):
    only = set(args.only.split(",")) if args.only else set(SECTIONS)
    types = args.types.split(",") if args.types else QUICK_GEMV_TYPES if args.quick else ALL_GEMV_TYPES
    for dt in types if "gemv" in only else []:
        r = bench_linear(be, rates, dt, 1, 4096, None, rng)
        r["pct_target"] = round(100 * r["gb_s"] / GEMV_TARGET_GBS)
        report["gemv"].append(r)
    batched = [("q4_k", 8)] if args.quick else [("q4_k", 8), ("q4_k", 32), ("q8_0", 16), ("q8_0", 64)]
    for dt, t in batched if "batched" in only else []:
        report["batched_decode"].append(bench_linear(be, rates, dt, t, 4096, None, rng, decode_rows=t))
    gemm_cases = [("f32", 128)] if args.quick else [("f32", 128), ("f32", 512), ("q4_1", 128), ("q8_0", 128),
                                                    ("q4_k", 512), ("f16", 512)]
    for dt, t in gemm_cases if "gemm" in only else []:
        r = bench_linear(be, rates, dt, t, 2048, 2048, rng)
        r["pct_target"] = round(100 * r["gflop_s"] / GEMM_TARGET_GFLOPS)
        report["gemm"].append(r)
    attention = [(1024, 1)] if args.quick else [(1024, 1), (4096, 1), (4096, 8)]
    for positions, tokens in attention if "attention" in only else []:
        report["attention"].append(bench_decode_attention(be, rates, positions, tokens=tokens))
    if "launch" in only:
        report["launch_overhead_us"] = round(launch_overhead_us(be, False), 2)
        if _core.opencl.device_info(be)["command_buffer"]:
            report["launch_overhead_command_buffer_us"] = round(launch_overhead_us(be, True), 2)


def print_family(r: dict):
    pct = lambda x, key: f" ({x[key]:5.1f}% of peak)" if key in x else ""
    busy = lambda x, key: f"   per busy core {x[key]:8.2f}" if key in x else ""
    print(f"== {r['kernels']} kernels")
    if "gpu_defines" in r or r["gemv"] or r["gemm"] or "launch_overhead_us" in r:
        print_kernels(r, pct, busy)
    for m in r["models"]:
        print(f"model {m['model'].split('/')[-1]}: pp{m['n_prompt']} {m['pp_tok_s']:.1f} tok/s, tg{m['n_gen']} "
              f"{m['tg_tok_s']:.1f} tok/s; decode step: {m['launches_per_step']} launches "
              f"({m['launches_per_layer']} per layer, {m['layers']} layers), {m['submits_per_step']} submits"
              f"{' as command buffers' if m['command_buffer'] else ''}, host {m['host_submit_us_per_step']:.0f} us "
              f"in submit, wall {m['wall_ms_per_step']:.2f} ms")


def print_kernels(r: dict, pct, busy):
    if "gpu_defines" in r:
        print(f"gpu family sizes:{r['gpu_defines']}")
    sections = [
        ("gemv", f"GEMV (1 token, K=4096, ~{WEIGHT_BYTES >> 20} MiB of weights; pocl target {GEMV_TARGET_GBS:g} GB/s)",
         lambda x: f"{x['dtype']:>6}: {x['gb_s']:8.2f} GB/s{pct(x, 'pct_peak_bw')}{busy(x, 'gb_s_busy')}   "
                   f"device {x['device_ms']:.3f} ms, wall {x['wall_ms']:.3f} ms, {x['launches']} launches"),
        ("batched_decode", "Batched decodes (8-bit activations; weight bytes read per step)",
         lambda x: f"{x['dtype']:>6} x{x['tokens']:3d}: {x['gb_s']:8.2f} GB/s{pct(x, 'pct_peak_bw')}   "
                   f"{x['tokens'] / x['device_ms'] * 1e3:10.0f} token-rows/s   device {x['device_ms']:.3f} ms"),
        ("gemm", f"GEMM (K=N=2048; pocl target {GEMM_TARGET_GFLOPS:g} GFLOP/s for f32)",
         lambda x: f"{x['dtype']:>6} T={x['tokens']:4d}: {x['gflop_s']:9.2f} GFLOP/s{pct(x, 'pct_peak_flops')}"
                   f"{busy(x, 'gflop_s_busy')}   device {x['device_ms']:.3f} ms"),
        ("attention", "Decode attention (f16 KV, 32 heads / 8 KV heads / head_dim 128; K+V bytes read)",
         lambda x: f"{x['tokens']} x {x['positions']:5d} positions: {x['gb_s']:8.2f} GB/s{pct(x, 'pct_peak_bw')}   "
                   f"device {x['device_ms']:.3f} ms, {x['launches']} launches"),
    ]
    for key, title, row in sections:
        if r[key]:
            print(title)
        for x in r[key]:
            print("  " + row(x))
    if "launch_overhead_us" in r:
        line = f"launch overhead: {r['launch_overhead_us']:.2f} us per queued kernel"
        if "launch_overhead_command_buffer_us" in r:
            line += f", {r['launch_overhead_command_buffer_us']:.2f} us in a command buffer"
        print(line)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="opencl")
    ap.add_argument("--kernels", default="cpu,gpu", help="kernel families to measure (default: cpu,gpu)")
    ap.add_argument("--model", action="append", default=None,
                    help="GGUF / model path, repeatable (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions, weight types and shapes")
    ap.add_argument("--no-model", action="store_true", help="kernels only")
    ap.add_argument("--no-kernels", action="store_true", help="models only")
    ap.add_argument("--only", default=None, help=f"kernel sections, comma-separated: {','.join(SECTIONS)}")
    ap.add_argument("--types", default=None, help="GEMV weight types, comma-separated (default: all)")
    ap.add_argument("--no-cpu-baseline", action="store_true", help="no model runs on the CPU backend")
    ap.add_argument("--peak-gbs", type=float, default=None, help="the device's memory bandwidth, GB/s")
    ap.add_argument("--peak-gflops", type=float, default=None, help="the device's f32 peak, GFLOP/s")
    ap.add_argument("--json", action="store_true", help="print the report as one JSON line")
    ap.add_argument("--json-out", default=None, help="also write the report as JSON to this file")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    info = _core.opencl.device_info(_core.make_backend(args.device))
    report = {"device": info, "load_avg_start": os.getloadavg()[0], "families": []}
    text = not args.json
    if text:
        print(f"device: {info['device']} ({info['platform']}, driver {info['driver_version']}), "
              f"{info['compute_units']} compute units, command buffers: {info['command_buffer']}; load average "
              f"{report['load_avg_start']:.1f} at the start", flush=True)

    def save():  # after each part, so a run cut short keeps what it measured
        report["load_avg_end"] = os.getloadavg()[0]
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(report, f, indent=1)

    for kernels in args.kernels.split(","):
        report["families"].append(bench_family(args, kernels, rng))
        save()
        if text:
            print_family(report["families"][-1])
            sys.stdout.flush()
    if not args.no_model and not args.no_cpu_baseline:
        report["cpu_models"] = [model_speed(m, "cpu", *((64, 16, 2) if args.quick else (128, 64, 3)))
                                for m in args.model or [None]]
        save()
    if args.json:
        print(json.dumps(report))
        return report
    for m in report.get("cpu_models", []):
        print(f"model {m['model'].split('/')[-1]} on the CPU backend: pp{m['n_prompt']} {m['pp_tok_s']:.1f} tok/s, "
              f"tg{m['n_gen']} {m['tg_tok_s']:.1f} tok/s")
    print(f"load average {report['load_avg_end']:.1f} at the end")
    return report


if __name__ == "__main__":
    main()
