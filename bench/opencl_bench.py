"""OpenCL backend speed: GEMV GB/s per weight type, GEMM GFLOP/s, launch overhead, and model
prompt-processing / generation tokens/s (next to the CPU backend).

    python bench/opencl_bench.py [--device opencl] [--model PATH] [--quick] [--json]

Kernel figures come from OpenCL profiling events (device time of the launch alone); the
"wall" figures include enqueueing. On a machine shared with other work the device time counts
the time pocl's threads wait for a core, so each kernel row also gives a "per busy core" rate:
work done per second of CPU time this process used (pocl's workers included), times the
device's compute units, which estimates the rate on an idle machine. The 1-minute load
average is printed with the results. Targets (shared/design/performance.md): GEMV >= 20 GB/s
of weight bytes, f32 GEMM >= 40 GFLOP/s on pocl.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from types import SimpleNamespace

# numpy's bundled OpenBLAS keeps its threads spinning after a call, taking cores from pocl's.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
import numpy as np  # noqa: E402

from ferrum import _core  # noqa: E402

GEMV_TARGET_GBS = 20.0
GEMM_TARGET_GFLOPS = 40.0
WEIGHT_BYTES = 96 << 20  # bigger than the last-level cache, so GEMV streams from DRAM


def random_weight(be, dtype: str, n: int, k: int, rng):
    """A [n, k] weight tensor in dtype: 64 distinct quantized rows tiled (quantizing ~100 MB of
    floats would dominate the run), plus its byte size."""
    base = rng.standard_normal((64, k)).astype(np.float32)
    if dtype == "f32":
        rows = base
    elif dtype == "f16":
        rows = base.astype(np.float16)
    else:
        rows = np.stack([_core.quant.quantize(dtype, r) for r in base])
    data = np.ascontiguousarray(np.tile(rows, (n // 64 + 1, 1))[:n])
    if dtype in ("f32", "f16"):
        return be.tensor(data), data.nbytes
    return be.tensor_raw(data.reshape(-1), dtype, [n, k]), data.nbytes


def device_seconds(be, stream, reps: int) -> float:
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


def bench_linear(be, dtype: str, tokens: int, k: int, n: int | None, reps: int, rng):
    row_bytes = k * 4 if dtype == "f32" else k * 2 if dtype in ("f16", "bf16") else None
    if n is None:
        if row_bytes is None:
            row_bytes = len(_core.quant.quantize(dtype, np.zeros(k, np.float32)))
        n = max(64, WEIGHT_BYTES // row_bytes)
    w, nbytes = random_weight(be, dtype, n, k, rng)
    x = be.tensor(rng.standard_normal((tokens, k)).astype(np.float32))
    out = be.empty("f32", [tokens, n])
    s = be.stream()
    be.linear(x, w, None, out, stream=s)
    dev = device_seconds(be, s, reps)
    wall = wall_seconds(s, reps)
    busy = cpu_seconds(s, reps) / _core.opencl.device_info(be)["compute_units"]
    flop = 2.0 * tokens * n * k
    return dict(dtype=dtype, tokens=tokens, k=k, n=n, weight_mib=round(nbytes / 2**20, 1),
                device_ms=round(dev * 1e3, 3), wall_ms=round(wall * 1e3, 3),
                gb_s=round(nbytes / dev / 1e9, 2), gflop_s=round(flop / dev / 1e9, 2),
                gb_s_busy=round(nbytes / busy / 1e9, 2), gflop_s_busy=round(flop / busy / 1e9, 2))


def launch_overhead_us(be, launches: int = 400) -> float:
    """Wall time per launch of a stream of tiny kernels (what one decode step pays per op)."""
    gate_up = be.tensor(np.ones((1, 128), np.float32))
    out = be.empty("f32", [1, 64])
    s = be.stream()
    for _ in range(launches):
        be.swiglu(gate_up, out, stream=s)
    return wall_seconds(s, 5) / launches * 1e6


def model_speed(model: str, device: str, n_prompt: int, n_gen: int, reps: int) -> dict:
    from ferrum.bench import run_bench
    args = SimpleNamespace(model_path=model, device=device, threads=2, n_prompt=n_prompt,
                           n_gen=n_gen, repetitions=reps, json=True)
    return run_bench(args)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="opencl")
    ap.add_argument("--model", default=None, help="GGUF / model path (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions and weight types")
    ap.add_argument("--no-model", action="store_true", help="kernels only")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    be = _core.make_backend(args.device)
    info = _core.opencl.device_info(be)
    reps = 5 if args.quick else 10
    report = {"device": info, "load_avg_start": os.getloadavg()[0], "gemv": [], "gemm": []}

    gemv_types = ["f16", "q8_0", "q4_1", "q4_k"] if args.quick else \
        ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k"]
    for dt in gemv_types:
        r = bench_linear(be, dt, 1, 4096, None, reps, rng)
        r["pct_target"] = round(100 * r["gb_s"] / GEMV_TARGET_GBS)
        r["pct_target_busy"] = round(100 * r["gb_s_busy"] / GEMV_TARGET_GBS)
        report["gemv"].append(r)
    for dt, t in [("f32", 128), ("f32", 512), ("q4_1", 128), ("q8_0", 128)] if not args.quick else [("f32", 128)]:
        r = bench_linear(be, dt, t, 2048, 2048, max(3, reps // 2), rng)
        r["pct_target"] = round(100 * r["gflop_s"] / GEMM_TARGET_GFLOPS)
        r["pct_target_busy"] = round(100 * r["gflop_s_busy"] / GEMM_TARGET_GFLOPS)
        report["gemm"].append(r)
    report["launch_overhead_us"] = round(launch_overhead_us(be), 2)
    report["load_avg_end"] = os.getloadavg()[0]
    if not args.no_model:
        n_prompt, n_gen = (64, 16) if args.quick else (128, 32)
        report["model"] = [model_speed(args.model, dev, n_prompt, n_gen, 2 if args.quick else 3)
                           for dev in (args.device, "cpu")]
    report["load_avg_end"] = os.getloadavg()[0]

    if args.json:
        print(json.dumps(report))
        return report
    print(f"device: {info['device']} ({info['platform']}, driver {info['driver_version']}), "
          f"{info['compute_units']} compute units; load average {report['load_avg_start']:.1f} -> "
          f"{report['load_avg_end']:.1f}")
    print(f"GEMV (1 token, K=4096, ~{WEIGHT_BYTES >> 20} MiB of weights; target {GEMV_TARGET_GBS:g} GB/s)")
    for r in report["gemv"]:
        print(f"  {r['dtype']:>5}: {r['gb_s']:7.2f} GB/s ({r['pct_target']:3d}% of target)   per busy core "
              f"{r['gb_s_busy']:7.2f} GB/s ({r['pct_target_busy']:3d}%)   device {r['device_ms']:.3f} ms, wall {r['wall_ms']:.3f} ms")
    print(f"GEMM (K=N=2048; target {GEMM_TARGET_GFLOPS:g} GFLOP/s for f32)")
    for r in report["gemm"]:
        print(f"  {r['dtype']:>5} T={r['tokens']:4d}: {r['gflop_s']:7.2f} GFLOP/s ({r['pct_target']:3d}% of target)   "
              f"per busy core {r['gflop_s_busy']:7.2f} GFLOP/s ({r['pct_target_busy']:3d}%)   device {r['device_ms']:.3f} ms")
    print(f"launch overhead: {report['launch_overhead_us']:.2f} us per queued kernel")
    for m in report.get("model", []):
        print(f"model {m['model'].split('/')[-1]} on {m['device']}: pp{m['n_prompt']} {m['pp_tok_s']:.1f} tok/s, "
              f"tg{m['n_gen']} {m['tg_tok_s']:.1f} tok/s")
    return report


if __name__ == "__main__":
    main()
