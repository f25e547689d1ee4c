"""Decode speed against the memory bandwidth of the moment: for each round and model, a bandwidth
reading, one `ferrum bench` process (tg128, best of --reps: the first repetition also records the
decode step), another reading; prints tok/s, GB/s streamed and the share of the two readings' mean. This VM's bandwidth moves between phases (32-35 and 55-60 GB/s) within
seconds to minutes, so a table's median reading can belong to another phase than its runs; runs
whose two readings agree show what the decode reaches in each phase.

usage: python bench/bracketed_tg.py MODEL [MODEL ...] [-r 6] [--reps 2] [-n 128] [-t 2]
"""
import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from moe_bench import measure_bandwidth_gbs  # noqa: E402
from perf_table import bytes_per_token  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("-r", type=int, default=6, help="rounds")
    ap.add_argument("--reps", type=int, default=2, help="tg repetitions per process (best of)")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", type=int, default=2)
    a = ap.parse_args()
    per_token = {m: bytes_per_token(m) for m in a.models}
    print("model | reading before / after GB/s | tg tok/s | streamed GB/s | share of the mean reading")
    for _ in range(a.r):
        for m in a.models:
            before = measure_bandwidth_gbs(a.t)
            out = subprocess.run([sys.executable, "-m", "ferrum", "bench", m, "-p", "16", "-n", str(a.n), "-t",
                                  str(a.t), "-r", str(a.reps), "--json"], capture_output=True, text=True, check=True)
            tg = json.loads(out.stdout.strip().splitlines()[-1])["tg_tok_s"]
            after = measure_bandwidth_gbs(a.t)
            gbs = tg * per_token[m] / 1e9
            print(f"{os.path.basename(m.rstrip('/'))} | {before:.1f} / {after:.1f} | {tg:.1f} | {gbs:.1f} | "
                  f"{gbs / ((before + after) / 2):.2f}", flush=True)


if __name__ == "__main__":
    main()
