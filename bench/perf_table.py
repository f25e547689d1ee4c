"""The performance table of docs/performance.md: every model side by side with llama.cpp, as
ratios and as shares of the decode bandwidth ceiling.

usage: python bench/perf_table.py MODEL [MODEL ...] [-p 128] [-n 128] [-t 2] [-r 3] [--out FILE.json]

MODEL is a GGUF (ferrum and llama.cpp alternate in fresh processes, A B A B ...) or an HF
safetensors directory (ferrum only: llama.cpp does not read safetensors). Before and after each
ferrum run the read bandwidth is measured (torch sum over 1 GiB, -t threads); the ceiling is the
median bandwidth / the bytes one decoded token reads (every weight tensor, but an untied embedding
counts one row; MoE experts count top_k / num_experts), and each run is also set against its own
two readings (the median over rounds whose readings agree: the paired share). Prints a markdown
table (medians) and writes every run to --out.
"""
import argparse
import datetime
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from compare_llamacpp import PEER, run  # noqa: E402
from moe_bench import measure_bandwidth_gbs  # noqa: E402


def gguf_bytes_per_token(path):
    import gguf
    r = gguf.GGUFReader(path)
    arch = str(r.fields["general.architecture"].contents())
    experts = r.fields.get(f"{arch}.expert_count")
    share = (int(r.fields[f"{arch}.expert_used_count"].contents()) / int(experts.contents())) if experts else 1.0
    tied = not any(t.name == "output.weight" for t in r.tensors)
    total = 0.0
    for t in r.tensors:
        if t.name == "token_embd.weight" and not tied:
            continue  # one row per token
        total += int(t.n_bytes) * (share if "_exps." in t.name else 1.0)
    return total


def safetensors_bytes_per_token(directory):
    from safetensors import safe_open
    tensors = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), "np") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    count = 1
                    for d in sl.get_shape():
                        count *= d
                    tensors[key] = count * {"F32": 4, "F16": 2, "BF16": 2}[sl.get_dtype()]
    tied = "lm_head.weight" not in tensors
    return sum(n for k, n in tensors.items() if tied or not k.endswith("embed_tokens.weight"))


def bytes_per_token(model):
    return gguf_bytes_per_token(model) if model.endswith(".gguf") else safetensors_bytes_per_token(model)


def ferrum_run(model, a):
    flags = ["-S"] if sys.flags.no_site else []  # a worktree testing its own sources
    return run([sys.executable, *flags, "-m", "ferrum", "bench", model, "-p", str(a.p), "-n", str(a.n),
                "-t", str(a.t), "--json"])


def measure(model, a):
    is_gguf = model.endswith(".gguf")
    per_token = bytes_per_token(model)
    ours, peer, readings, loads = [], [], [], []
    for _ in range(a.r):
        loads.append(round(os.getloadavg()[0], 2))
        before = measure_bandwidth_gbs(a.t)
        ours.append(ferrum_run(model, a))
        readings.append([round(before, 1), round(measure_bandwidth_gbs(a.t), 1)])
        if is_gguf:
            peer.append(run(["bash", PEER, model, str(a.p), str(a.n), str(a.t)]))
    med = lambda rows, k: statistics.median(r[k] for r in rows) if rows else None  # noqa: E731
    bw = statistics.median(x for pair in readings for x in pair)
    # Each run against the readings just before and after it: this VM's bandwidth moves between
    # phases (~33 and 55-60 GB/s) within seconds, so the median run over the median reading can
    # compare two phases. Rounds whose readings differ by more than 15% changed phase midway.
    steady = [r["tg_tok_s"] * per_token / 1e9 / ((b + e) / 2) for r, (b, e) in zip(ours, readings)
              if abs(b - e) <= 0.15 * max(b, e)]
    return {"model": os.path.basename(model.rstrip("/")), "bytes_per_token": per_token,
            "bandwidth_gbs": round(bw, 1), "ceiling_tok_s": round(bw * 1e9 / per_token, 1), "load_average": loads,
            "readings_gbs": readings, "steady_rounds": len(steady),
            "paired_share": round(statistics.median(steady), 3) if steady else None,
            "ferrum": {k: med(ours, k) for k in ("pp_tok_s", "tg_tok_s", "engine_rss_mib", "engine_rss_vs_bound")},
            "llama.cpp": {k: med(peer, k) for k in ("pp_tok_s", "tg_tok_s")} if peer else None,
            "runs_ferrum": ours, "runs_llamacpp": peer}


def cell(row):
    f, l, roof = row["ferrum"], row["llama.cpp"], row["ceiling_tok_s"]
    text = f"{f['pp_tok_s']:.0f} / {f['tg_tok_s']:.1f}"
    if l:
        text += f" ({f['pp_tok_s'] / l['pp_tok_s']:.2f}x / {f['tg_tok_s'] / l['tg_tok_s']:.2f}x)"
    text += f", {100 * f['tg_tok_s'] / roof:.0f}% of ceiling"
    if row["paired_share"] is not None:
        text += f", {100 * row['paired_share']:.0f}% of its own readings ({row['steady_rounds']} steady rounds)"
    return text


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("-p", type=int, default=128)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("--out")
    a = ap.parse_args()
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # the same ferrum in children
    rows = []
    for model in a.models:
        rows.append(measure(os.path.expanduser(model), a))
        r = rows[-1]
        print(f"| {r['model']} | {cell(r)} | llama.cpp {r['llama.cpp']} | ceiling {r['ceiling_tok_s']} tok/s "
              f"at {r['bandwidth_gbs']} GB/s | engine RSS {r['ferrum']['engine_rss_mib']} MiB "
              f"({100 * r['ferrum']['engine_rss_vs_bound']:.0f}% of bound) | load {r['load_average']} |", flush=True)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "n_prompt": a.p, "n_gen": a.n, "threads": a.t, "runs": a.r,
                       # the caps both engines ran under (docs/performance.md, "AVX2")
                       "ferrum_cpu_isa": os.environ.get("FERRUM_CPU_ISA", "native"),
                       "llama_cpp_isa": os.environ.get("LLAMA_CPP_ISA", "native"), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
