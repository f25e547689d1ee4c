"""4-bit GPTQ / AWQ / compressed-tensors checkpoints (docs/models.md) on the TinyLlama-1.1B shape:
ferrum's pp / tg on each, tg as a share of the bandwidth roof, llama.cpp on the same model as Q4_0
and Q4_K_M GGUF, transformers running the checkpoints on the CPU, and ferrum's memory.

usage: python bench/quant_ckpt_bench.py [-p 128] [-n 128] [-t 2] [-r 3] [--hf-tokens 8]
                                        [--data-dir ~/.cache/ferrum-bench] [--out FILE.json]

The checkpoints (4 bits, groups of 128, one random f16 model with seed 0) are written once into
--data-dir: GPTQ (sym) quantized by GPTQModel itself (8 short calibration texts, as
tests/test_gptq.py does); GPTQ act-order (desc_act) as that file's codes regrouped in a random input
order per module (write_act_order); AWQ (gemm, zero points) as min-max codes packed by
GPTQModel's own AWQ gemm packer (GPTQModel's act-order and AWQ searches take as long again
each on 2 cores; speed does not depend on the codes); compressed-tensors pack-quantized W4A16 (symmetric) as
tests/test_compressed_tensors.py writes it, its float tensors then stored in f16; the GGUFs by
ferrum's generator from the same random weights. Each checkpoint is checked once against its
library's own dequantization (ferrum's weights equal it exactly, every module) before it is measured.

Per round (-r rounds, the order reversed every other round): every model by `ferrum bench` in a
fresh process with the read bandwidth (a torch sum over 1 GiB, -t threads) before and after it,
and llama.cpp (../shared/bench/llamacpp/run.sh) after ferrum on each GGUF. The roof is the read
bandwidth over the bytes a token reads as ferrum holds the weights (GPTQ / AWQ / compressed-tensors
translated into Q4_0 / Q5_0 blocks; the untied embedding not counted); each run's share is against
its own two readings. After the rounds, transformers (GPTQModel's torch kernels for GPTQ / AWQ;
compressed-tensors decompressing W4A16 at load) generates 1 + --hf-tokens greedy tokens from a
-p token prompt once per checkpoint, tg timed from the first new token to the last. Prints a
markdown table (medians) and writes every run and the 1-minute load averages to --out.
"""
import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from compare_llamacpp import PEER, run  # noqa: E402
from moe_bench import measure_bandwidth_gbs  # noqa: E402

TOK = os.path.join(ROOT, "..", "shared", "models", "tokenizers", "llama2")
PRESET = "tinyllama-1.1b"
GROUP = 128
# name: (GPTQModel QuantizeConfig keywords, quantize() keywords)
GPTQMODEL_JOBS = {
    "gptq": (dict(bits=4, group_size=GROUP, sym=True, desc_act=False, format="gptq"), {}),
}
# GPTQModel's AWQ search takes as long again on 2 cores: the AWQ file holds min-max codes instead,
# packed by GPTQModel's own gemm packer (the layout AWQ's quantizer writes; speed does not depend
# on the codes).
AWQ_CONFIG = {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": GROUP, "zero_point": True}
CHECKPOINTS = ["gptq", "gptq-act-order", "awq", "compressed-tensors"]
GGUFS = ["q4_0", "q4_k_m"]


def _tests_on_path():
    """The test suite's checkpoint writers and library references, used here as they are there."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))


def _publish(part, final):
    os.replace(part, final)
    return Path(final)


def float_source(d):
    path = d / f"{PRESET}-hf-f16-llama2tok"
    if not path.exists():
        from ferrum.tools.make_model import make_model
        shutil.rmtree(str(path) + ".part", ignore_errors=True)
        make_model("llama", PRESET, "hf", "f16", seed=0, tokenizer=TOK, out=str(path) + ".part")
        _publish(str(path) + ".part", path)
    return path


def write_gptqmodel(src, out, job):
    _tests_on_path()
    from test_gptq import QUANTIZE
    part = Path(str(out) + ".part")
    shutil.rmtree(part, ignore_errors=True)
    env = dict(os.environ, GPTQMODEL_CPU_WORKERS="2", CUDA_VISIBLE_DEVICES="")
    subprocess.run([sys.executable, "-c", QUANTIZE, str(src), json.dumps({str(part): job})],
                   check=True, env=env, cwd=src.parent, stdout=subprocess.DEVNULL)
    return _publish(part, out)


def write_act_order(plain, out, seed=0):
    """GPTQModel's plain checkpoint with each module's inputs regrouped as act-order groups them:
    a random order per input (q/k/v and gate/up share theirs, as GPTQModel gives them one), group
    g the inputs at ranks g x GROUP onwards, each keeping its codes, the scales and zeros as they
    are; qweight repacked in the inputs' order and g_idx written as GPTQModel writes it with
    desc_act (a different model, the same work: GPTQModel's act-order search takes as long again
    as its plain one on 2 cores)."""
    import numpy as np
    import torch
    from safetensors.torch import load_file, save_file
    part = Path(str(out) + ".part")
    shutil.rmtree(part, ignore_errors=True)
    shutil.copytree(plain, part, ignore=shutil.ignore_patterns("*.safetensors"))
    st = load_file(plain / "model.safetensors")
    rng = np.random.default_rng(seed)
    shares = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}
    orders = {}
    for name in sorted(k[:-len(".qweight")] for k in st if k.endswith(".qweight")):
        packed = st[name + ".qweight"].numpy().view(np.uint32)  # [K / 8, N], input 8r + b at bits 4b
        K = packed.shape[0] * 8
        prefix, module = name.rsplit(".", 1)
        key = prefix + "." + shares.get(module, module)
        if key not in orders:
            orders[key] = rng.permutation(K)
        order = orders[key]  # input j of the plain file becomes input order[j]
        codes = (packed[:, None, :] >> (4 * np.arange(8, dtype=np.uint32))[None, :, None]) & 15
        moved = np.empty_like(codes.reshape(K, -1))
        moved[order] = codes.reshape(K, -1)
        repacked = (moved.reshape(K // 8, 8, -1) << (4 * np.arange(8, dtype=np.uint32))[None, :, None]).sum(
            1, dtype=np.uint32)
        g_idx = np.empty(K, dtype=np.int32)
        g_idx[order] = np.arange(K, dtype=np.int32) // GROUP
        st[name + ".qweight"] = torch.from_numpy(repacked.view(np.int32).copy())
        st[name + ".g_idx"] = torch.from_numpy(g_idx)
    save_file(st, part / "model.safetensors", metadata={"format": "pt"})
    for f in ("config.json", "quantize_config.json"):
        if (part / f).exists():
            c = json.loads((part / f).read_text())
            (c["quantization_config"] if f == "config.json" else c)["desc_act"] = True
            (part / f).write_text(json.dumps(c, indent=2))
    return _publish(part, out)


def write_awq(src, out):
    """src's linear modules as min-max 4-bit codes with zero points, groups of GROUP inputs, f16
    scales, packed by GPTQModel's gemm packer (AwqTorchLinear, its CPU one); the rest of src as stored."""
    import torch
    from safetensors.torch import load_file, save_file
    _tests_on_path()
    from test_gptq import gptqmodel_imports
    with gptqmodel_imports():
        from gptqmodel.nn_modules.qlinear.torch_awq import AwqTorchLinear
    part = Path(str(out) + ".part")
    shutil.rmtree(part, ignore_errors=True)
    shutil.copytree(src, part, ignore=shutil.ignore_patterns("*.safetensors"))
    st = load_file(src / "model.safetensors")
    for name in [k for k in st if k.endswith("proj.weight")]:
        w = st.pop(name).float()
        N, K = w.shape
        g = w.unflatten(1, (K // GROUP, GROUP))
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scales = ((hi - lo) / 15).clamp(min=1e-5).half()  # [N, groups]
        zeros = (-lo / scales.float()).round().clamp(0, 15)
        codes = (g / scales.float()[..., None]).round().add(zeros[..., None]).clamp(0, 15)
        # the packer rounds (w + z s) / s: weights already on the grid give back the codes
        linear = torch.nn.Linear(K, N, bias=False)
        linear.weight.data = ((codes - zeros[..., None]) * scales.float()[..., None]).flatten(1)
        m = AwqTorchLinear(bits=4, group_size=GROUP, sym=False, desc_act=False, in_features=K, out_features=N)
        m.pack(linear, scales, zeros)
        for k in ("qweight", "qzeros", "scales"):
            st[name[:-len(".weight")] + "." + k] = getattr(m, k).contiguous()
    save_file(st, part / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((part / "config.json").read_text())
    config["quantization_config"] = AWQ_CONFIG
    (part / "config.json").write_text(json.dumps(config, indent=2))
    return _publish(part, out)


def write_compressed_tensors(src, out):
    _tests_on_path()
    from test_compressed_tensors import weights, write_checkpoint
    part = Path(str(out) + ".part")
    shutil.rmtree(part, ignore_errors=True)
    write_checkpoint(src, part, {"group_0": (["Linear"], weights(4, "group", GROUP))}, ["lm_head"])
    # The writer works in f32; a W4A16 file keeps its float tensors in the model's 16-bit dtype
    # (the scales already hold f16 values, so only the unquantized weights change).
    from safetensors.torch import load_file, save_file
    import torch
    st = load_file(part / "model.safetensors")
    save_file({k: v.half() if v.dtype == torch.float32 and not k.endswith("_scale") else v for k, v in st.items()},
              part / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((part / "config.json").read_text())
    config["dtype"] = config["torch_dtype"] = "float16"
    (part / "config.json").write_text(json.dumps(config, indent=2))
    return _publish(part, out)


def library_dequantized(name, path):
    _tests_on_path()
    if name.startswith("gptq"):
        import test_gptq
        return test_gptq.library_dequantized(path)
    if name == "awq":
        import test_awq
        from safetensors.torch import load_file
        return test_awq._gemm_dequantized(load_file(path / "model.safetensors"),
                                          test_awq._config(path)["quantization_config"])
    import test_compressed_tensors
    return test_compressed_tensors.library_dequantized(path)[0]


def verify(name, path):
    """ferrum's weights against the library's own dequantization, every quantized module, once."""
    marker = path / "ferrum-verified.json"
    if marker.exists():
        return json.loads(marker.read_text())
    import numpy as np
    import ferrum
    mf = ferrum._core.ModelFile(str(path))
    ref = library_dequantized(name, path)
    modules = sorted(k for k in ref if k.endswith("proj.weight"))
    types = {}
    for k in modules:
        np.testing.assert_array_equal(mf.dequantized(k), ref[k].numpy(), err_msg=f"{name}: {k}")
        types[mf.tensors[k][0]] = types.get(mf.tensors[k][0], 0) + 1
    result = {"modules_equal_library_dequantization": len(modules), "held_as": types}
    marker.write_text(json.dumps(result))
    return result


def prepare(d):
    """Every file, written once into d (a .part name until complete)."""
    d.mkdir(parents=True, exist_ok=True)
    src = float_source(d)
    paths = {}
    for name, job in GPTQMODEL_JOBS.items():
        out = d / f"{PRESET}-{name}-4bit-g{GROUP}"
        if not out.exists():
            t0 = time.time()
            write_gptqmodel(src, out, job)
            print(f"{name}: written by GPTQModel in {time.time() - t0:.0f} s", flush=True)
        paths[name] = out
    out = d / f"{PRESET}-gptq-act-order-4bit-g{GROUP}"
    paths["gptq-act-order"] = out if out.exists() else write_act_order(paths["gptq"], out)
    out = d / f"{PRESET}-awq-4bit-g{GROUP}"
    paths["awq"] = out if out.exists() else write_awq(src, out)
    out = d / f"{PRESET}-compressed-tensors-w4a16-g{GROUP}"
    paths["compressed-tensors"] = out if out.exists() else write_compressed_tensors(src, out)
    for q in GGUFS:
        out = d / f"{PRESET}-{q}.gguf"
        if not out.exists():
            from ferrum.tools.make_model import make_model
            make_model("llama", PRESET, "gguf", q, seed=0, tokenizer=os.path.join(TOK, "tokenizer.model"),
                       out=str(out) + ".part")
            _publish(str(out) + ".part", out)
        paths[q] = out
    checks = {}
    for name in CHECKPOINTS:
        checks[name] = verify(name, paths[name])
        print(f"{name}: {checks[name]}", flush=True)
    return paths, checks


def held_bytes_per_token(path):
    """The bytes one decoded token reads as ferrum holds the weights: every tensor in its held
    block type, the embedding one row when an lm_head is separate."""
    import gguf
    import ferrum
    tensors = ferrum._core.ModelFile(str(path)).tensors
    embedding = {"token_embd.weight", "model.embed_tokens.weight"}
    tied = not ({"output.weight", "lm_head.weight"} & set(tensors))
    total = 0
    for name, (dtype, shape) in tensors.items():
        if name in embedding and not tied:
            continue
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[dtype.upper()]]
        count = 1
        for d in shape:
            count *= d
        total += count // block * size
    return total


HF_SCRIPT = """
import json, resource, sys, time
import torch
path, prompt_tokens, new_tokens, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(threads)
from transformers import AutoModelForCausalLM
t0 = time.perf_counter()
model = AutoModelForCausalLM.from_pretrained(path, device_map="cpu")
load_s = time.perf_counter() - t0
ids = torch.randint(1, model.config.vocab_size, (1, prompt_tokens), generator=torch.Generator().manual_seed(0))
kinds = sorted({type(m).__name__ for m in model.modules() if "proj" in type(m).__name__.lower()
                or "linear" in type(m).__name__.lower()})
from transformers.generation.streamers import BaseStreamer
class Clock(BaseStreamer):  # generate() puts the prompt, then each new token
    def __init__(self):
        self.times = []
    def put(self, value):
        self.times.append(time.perf_counter())
    def end(self):
        pass
clock = Clock()
t0 = time.perf_counter()
with torch.no_grad():
    model.generate(ids, max_new_tokens=new_tokens + 1, min_new_tokens=new_tokens + 1, do_sample=False, streamer=clock)
first, last, made = clock.times[1], clock.times[-1], len(clock.times) - 1
print(json.dumps({"load_s": round(load_s, 1), "pp_tok_s": round(prompt_tokens / (first - t0), 2),
                  "tg_tok_s": round((made - 1) / (last - first), 3), "new_tokens": made - 1,
                  "linear_modules": kinds, "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}))
"""


def transformers_run(path, a):
    """transformers on the checkpoint (its own quantization integration: GPTQModel's kernels for
    GPTQ / AWQ, compressed-tensors for W4A16), or why it does not run."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", GPTQMODEL_CPU_WORKERS=str(a.t))
    p = subprocess.run([sys.executable, "-c", HF_SCRIPT, str(path), str(a.p), str(a.hf_tokens), str(a.t)],
                       capture_output=True, text=True, env=env, timeout=1800)
    if p.returncode != 0:
        return {"error": (p.stderr.strip().splitlines() or ["exit %d" % p.returncode])[-1][:300]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def loadavg():
    return round(os.getloadavg()[0], 2)


def ferrum_cmd(model, a):
    flags = ["-S"] if sys.flags.no_site else []  # a worktree testing its own sources
    return [sys.executable, *flags, "-m", "ferrum", "bench", str(model), "-p", str(a.p), "-n", str(a.n),
            "-t", str(a.t), "--json"]


def measure(paths, a):
    names = CHECKPOINTS + GGUFS
    ours = {n: [] for n in names}
    readings = {n: [] for n in names}
    peer = {q: [] for q in GGUFS}
    loads = [loadavg()]
    for rnd in range(a.r):
        order = names if rnd % 2 == 0 else names[::-1]  # alternating: a slow phase hits no one always
        for n in order:
            before = measure_bandwidth_gbs(a.t)
            ours[n].append(run(ferrum_cmd(paths[n], a)))
            readings[n].append([round(before, 1), round(measure_bandwidth_gbs(a.t), 1)])
            if n in peer:
                peer[n].append(run(["bash", PEER, str(paths[n]), str(a.p), str(a.n), str(a.t)]))
            loads.append(loadavg())
            print(f"round {rnd + 1}: {n} tg {ours[n][-1]['tg_tok_s']} bw {readings[n][-1]} load {loads[-1]}",
                  flush=True)
    hf = {}
    for n in CHECKPOINTS:
        hf[n] = transformers_run(paths[n], a)
        loads.append(loadavg())
        print(f"transformers {n}: {hf[n]}", flush=True)
    return ours, readings, peer, hf, loads


def summarize(paths, checks, ours, readings, peer, hf):
    med = lambda rows, k: statistics.median(r[k] for r in rows)  # noqa: E731
    rows = {}
    for n, runs in ours.items():
        per_token = held_bytes_per_token(paths[n])
        bw = statistics.median(x for pair in readings[n] for x in pair)
        # each run against the mean of its own two readings (this VM's bandwidth changes phase)
        shares = [r["tg_tok_s"] * per_token / 1e9 / ((b + e) / 2) for r, (b, e) in zip(runs, readings[n])]
        f = {k: med(runs, k) for k in ("pp_tok_s", "tg_tok_s", "engine_rss_mib", "file_mib", "kv_mib")}
        rows[n] = {"path": str(paths[n]), "held_bytes_per_token": per_token, "bandwidth_gbs": round(bw, 1),
                   "roof_tok_s": round(bw * 1e9 / per_token, 1), "roof_share": round(statistics.median(shares), 3),
                   "ferrum": f, "rss_over_file_plus_kv": round(f["engine_rss_mib"] / (f["file_mib"] + f["kv_mib"]), 3),
                   "readings_gbs": readings[n], "runs_ferrum": runs}
        if n in peer:
            rows[n]["llama.cpp"] = {k: med(peer[n], k) for k in ("pp_tok_s", "tg_tok_s")}
            rows[n]["runs_llamacpp"] = [{k: r[k] for k in ("pp_tok_s", "tg_tok_s")} for r in peer[n]]
        if n in hf:
            rows[n]["transformers"] = hf[n]
        if n in checks:
            rows[n]["check"] = checks[n]
    tg = lambda n: rows[n]["ferrum"]["tg_tok_s"]  # noqa: E731
    pp = lambda n: rows[n]["ferrum"]["pp_tok_s"]  # noqa: E731
    ratios = {"act_order_tg_over_plain": round(tg("gptq-act-order") / tg("gptq"), 3)}
    for q in GGUFS:
        ratios[f"gptq_tg_over_llamacpp_{q}"] = round(tg("gptq") / rows[q]["llama.cpp"]["tg_tok_s"], 2)
        ratios[f"gptq_pp_over_llamacpp_{q}"] = round(pp("gptq") / rows[q]["llama.cpp"]["pp_tok_s"], 2)
    for n in CHECKPOINTS:
        t = hf[n].get("tg_tok_s")
        ratios[f"{n}_tg_over_transformers"] = round(tg(n) / t, 1) if t else None
    return rows, ratios


def table(rows, ratios, a):
    print(f"\n| model | ferrum pp{a.p} | ferrum tg{a.n} | tg share of roof | llama.cpp pp / tg | "
          f"transformers tg | engine RSS / (file + KV) |")
    print("|---|---|---|---|---|---|---|")
    for n, r in rows.items():
        f = r["ferrum"]
        peer = r.get("llama.cpp")
        peer = f"{peer['pp_tok_s']:.0f} / {peer['tg_tok_s']:.1f}" if peer else "-"
        hf = r.get("transformers")
        hf = "-" if hf is None else (f"{hf['tg_tok_s']:.2f}" if "tg_tok_s" in hf else "does not run")
        print(f"| {n} | {f['pp_tok_s']:.0f} | {f['tg_tok_s']:.1f} | {100 * r['roof_share']:.0f}% "
              f"({r['roof_tok_s']:.0f} tok/s at {r['bandwidth_gbs']} GB/s) | {peer} | {hf} | "
              f"{f['engine_rss_mib']:.0f} MiB / ({f['file_mib']:.0f} + {f['kv_mib']:.0f}) = "
              f"{r['rss_over_file_plus_kv']:.2f} |")
    print()
    for k, v in ratios.items():
        print(f"{k}: {v}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-p", type=int, default=128)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("-r", type=int, default=3, help="rounds of ferrum and llama.cpp (medians)")
    ap.add_argument("--hf-tokens", type=int, default=8, help="tokens transformers generates (after the first)")
    ap.add_argument("--data-dir", default="~/.cache/ferrum-bench")
    ap.add_argument("--out")
    a = ap.parse_args()
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # the same ferrum in children
    paths, checks = prepare(Path(a.data_dir).expanduser())
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    ours, readings, peer, hf, loads = measure(paths, a)
    rows, ratios = summarize(paths, checks, ours, readings, peer, hf)
    table(rows, ratios, a)
    print(f"1-minute load average during the run: {min(loads)}-{max(loads)} on {os.cpu_count()} cores")
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"date": started, "n_prompt": a.p, "n_gen": a.n, "threads": a.t, "rounds": a.r,
                       "hf_tokens": a.hf_tokens, "cores": os.cpu_count(), "load_average": loads,
                       "ratios": ratios, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
