"""ferrum vs llama.cpp on the same GGUF, side by side: alternating fresh processes, median of N.

usage: python bench/compare_llamacpp.py [MODEL.gguf] [-p 128] [-n 128] [-t 2] [-r 5] [--out FILE.json]
Prints pp / tg tokens/s for both engines and the ratios ferrum / llama.cpp; --out also writes
every run and the medians as JSON (bench/results/ keeps the runs the docs and notebooks quote).
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PEER = os.path.join(HERE, "..", "..", "shared", "bench", "llamacpp", "run.sh")
LOAD_AT_START = [round(x, 2) for x in os.getloadavg()]  # other work on the machine skews every figure


def run(cmd):
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("-p", type=int, default=128)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("-r", type=int, default=5)
    ap.add_argument("--out", default=None, help="also write the runs and medians to this JSON file")
    a = ap.parse_args()
    sys.path.insert(0, os.path.join(HERE, "..", "python"))
    from ferrum.models import resolve_model
    model = str(resolve_model(a.model))
    ours, peer = [], []
    for _ in range(a.r):  # A B A B ... in fresh processes
        # -S passes on a run without site-packages (a worktree testing its own sources)
        ours.append(run([sys.executable, *(["-S"] if sys.flags.no_site else []), "-m", "ferrum", "bench", model,
                         "-p", str(a.p), "-n", str(a.n), "-t", str(a.t), "--json"]))
        peer.append(run(["bash", PEER, model, str(a.p), str(a.n), str(a.t)]))
    med = lambda rows, k: statistics.median(r[k] for r in rows)
    print(f"model: {os.path.basename(model)}  threads: {a.t}  runs: {a.r} (median)")
    print(f"{'':10}{'ferrum':>12}{'llama.cpp':>12}{'ratio':>8}")
    for k, name in (("pp_tok_s", f"pp{a.p}"), ("tg_tok_s", f"tg{a.n}")):
        f, l = med(ours, k), med(peer, k)
        print(f"{name:10}{f:12.1f}{l:12.1f}{f / l:8.2f}")
    print(f"peak RSS ferrum: {med(ours, 'peak_rss_mib'):.0f} MiB, model file: {os.path.getsize(model) / 2**20:.0f} MiB")
    if a.out:
        write_results(a, model, ours, peer)


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def write_results(a, model, ours, peer):
    def summary(rows):
        return {k: statistics.median(r[k] for r in rows) for k in ("pp_tok_s", "tg_tok_s")}
    f, l = summary(ours), summary(peer)
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count(),
                    "load_average_start": LOAD_AT_START, "load_average_end": [round(x, 2) for x in os.getloadavg()]},
        "model": os.path.basename(model), "model_bytes": os.path.getsize(model),
        "n_prompt": a.p, "n_gen": a.n, "threads": a.t, "runs": a.r,
        "median": {"ferrum": {**f, "peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in ours)},
                   "llama.cpp": l},
        "ratio_ferrum_over_llamacpp": {k: round(f[k] / l[k], 3) for k in f},
        "runs_ferrum": [{k: r[k] for k in ("pp_tok_s", "tg_tok_s", "peak_rss_mib")} for r in ours],
        "runs_llamacpp": [{k: r[k] for k in ("pp_tok_s", "tg_tok_s")} for r in peer],
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(result, fh, indent=1)
        fh.write("\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
