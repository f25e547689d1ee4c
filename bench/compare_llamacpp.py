"""ferrum vs llama.cpp on the same GGUF, side by side: alternating fresh processes, median of N.

usage: python bench/compare_llamacpp.py [MODEL.gguf] [-p 128] [-n 128] [-t 2] [-r 5]
Prints pp / tg tokens/s for both engines and the ratios ferrum / llama.cpp.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PEER = os.path.join(HERE, "..", "..", "shared", "bench", "llamacpp", "run.sh")


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
    a = ap.parse_args()
    sys.path.insert(0, os.path.join(HERE, "..", "python"))
    from ferrum.models import resolve_model
    model = str(resolve_model(a.model))
    ours, peer = [], []
    for _ in range(a.r):  # A B A B ... in fresh processes
        ours.append(run([sys.executable, "-m", "ferrum", "bench", model, "-p", str(a.p), "-n", str(a.n),
                         "-t", str(a.t), "--json"]))
        peer.append(run(["bash", PEER, model, str(a.p), str(a.n), str(a.t)]))
    med = lambda rows, k: statistics.median(r[k] for r in rows)
    print(f"model: {os.path.basename(model)}  threads: {a.t}  runs: {a.r} (median)")
    print(f"{'':10}{'ferrum':>12}{'llama.cpp':>12}{'ratio':>8}")
    for k, name in (("pp_tok_s", f"pp{a.p}"), ("tg_tok_s", f"tg{a.n}")):
        f, l = med(ours, k), med(peer, k)
        print(f"{name:10}{f:12.1f}{l:12.1f}{f / l:8.2f}")
    print(f"peak RSS ferrum: {med(ours, 'peak_rss_mib'):.0f} MiB, model file: {os.path.getsize(model) / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
