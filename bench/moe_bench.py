"""Qwen3-MoE decode speed: ferrum vs llama.cpp on the same generated GGUF, and vs the bandwidth
ceiling of the bytes one token must read (active parameters only).

usage: python bench/moe_bench.py [--dtype q8_0] [--preset qwen3-moe-1b-a0.2b] [-p 128] [-n 128]
                                 [-t 2] [-r 5] [--data-dir ~/.cache/ferrum-bench]
                                 [--bandwidth-gbs X] [--quiet-load 2.5]
The model is written once into --data-dir (never into the repository). Engines alternate in
fresh processes (A B A B ...), -r runs; medians and bests are printed (on a shared machine the
best run is the one least disturbed by others). The ceiling is bandwidth / active bytes, where
active bytes = every non-expert tensor (the tied embedding counts in full: it is the output
projection) + top_k / num_experts of each expert tensor; the bandwidth is measured before every
round (torch sum over 1 GiB, -t threads, the median of 7 passes; the median round is used: single readings range from 30 to
50 GB/s here) unless given. --quiet-load waits (up to 3 minutes) before each round for the
1-minute load average to fall below it: on a shared machine other people's jobs otherwise
decide the figures.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "python"))
sys.path.insert(0, HERE)
from compare_llamacpp import PEER, run  # noqa: E402


def write_model(preset, dtype, data_dir):
    from ferrum.tools.make_model import make_model
    tok = os.path.join(HERE, "..", "..", "shared", "models", "tokenizers", "smollm2-135m-instruct")
    path = os.path.join(os.path.expanduser(data_dir), f"qwen3moe-{preset}-{dtype}.gguf")
    if not os.path.exists(path):
        t0 = time.time()
        tmp = path + ".part"
        make_model("qwen3_moe", preset, "gguf", dtype, seed=0, tokenizer=tok, out=tmp)
        os.replace(tmp, path)
        print(f"wrote {path} in {time.time() - t0:.0f} s", file=sys.stderr)
    return path


def active_bytes(path):
    """(bytes read per decoded token, total tensor bytes) of a qwen3moe GGUF."""
    import gguf
    r = gguf.GGUFReader(path)
    E = int(r.fields["qwen3moe.expert_count"].contents())
    k = int(r.fields["qwen3moe.expert_used_count"].contents())
    tied = not any(t.name == "output.weight" for t in r.tensors)
    active = total = 0
    for t in r.tensors:
        n = int(t.n_bytes)
        total += n
        if "_exps." in t.name:
            active += n * k / E
        elif t.name != "token_embd.weight" or tied:  # an untied embedding is one row per token
            active += n
    return active, total


def measure_bandwidth_gbs(threads):
    import torch
    torch.set_num_threads(threads)
    a = torch.ones(1 << 28, dtype=torch.float32)  # 1 GiB
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        a.sum()
        times.append(time.perf_counter() - t0)
    # The median pass, not the fastest: single passes on this VM occasionally read ~56 GB/s
    # where the machine sustains 32-35 (two 1-thread readers together get the same 35).
    return a.numel() * 4 / statistics.median(times) / 1e9


def ferrum_cmd(model, a):
    # Run this tree's ferrum: the same interpreter flags and sys.path as this process. One
    # repetition, as the peer times its generation once (its pp is best of 3: ours is not).
    flags = ["-S"] if sys.flags.no_site else []
    return [sys.executable, *flags, "-m", "ferrum", "bench", model, "-p", str(a.p), "-n", str(a.n),
            "-t", str(a.t), "-r", "1", "--json"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3-moe-1b-a0.2b")
    ap.add_argument("--dtype", default="q8_0")
    ap.add_argument("--data-dir", default="~/.cache/ferrum-bench")
    ap.add_argument("-p", type=int, default=128)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("-r", type=int, default=5)
    ap.add_argument("--bandwidth-gbs", type=float)
    ap.add_argument("--quiet-load", type=float)
    a = ap.parse_args()
    os.makedirs(os.path.expanduser(a.data_dir), exist_ok=True)
    model = write_model(a.preset, a.dtype, a.data_dir)
    active, total = active_bytes(model)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)

    ours, peer, bws, loads = [], [], [], []
    for _ in range(a.r):
        deadline = time.time() + 180
        while a.quiet_load and os.getloadavg()[0] > a.quiet_load and time.time() < deadline:
            time.sleep(5)
        loads.append(os.getloadavg()[0])
        bws.append(a.bandwidth_gbs or measure_bandwidth_gbs(a.t))
        ours.append(run(ferrum_cmd(model, a)))
        peer.append(run(["bash", PEER, model, str(a.p), str(a.n), str(a.t)]))
    bw = statistics.median(bws)
    ceiling = bw * 1e9 / active
    print(f"model: {os.path.basename(model)}  {total / 1e9:.2f} GB on disk, {active / 1e6:.0f} MB read "
          f"per token  threads: {a.t}  runs: {a.r}")
    print(f"1-min load average before each round: {', '.join(f'{x:.1f}' for x in loads)}")
    print(f"bandwidth {bw:.1f} GB/s (runs: {', '.join(f'{b:.1f}' for b in bws)}) -> decode ceiling "
          f"{ceiling:.1f} tok/s")
    print(f"{'':13}{'ferrum':>10}{'llama.cpp':>11}{'ratio':>7}{'ferrum/ceiling':>16}{'llama.cpp/ceiling':>19}")
    for key, name in (("pp_tok_s", f"pp{a.p}"), ("tg_tok_s", f"tg{a.n}")):
        for stat, fn in (("median", statistics.median), ("best", max)):
            f, l = fn(r[key] for r in ours), fn(r[key] for r in peer)
            roof = f"{f / ceiling:16.2f}{l / ceiling:19.2f}" if key == "tg_tok_s" else ""
            print(f"{name + ' ' + stat:13}{f:10.1f}{l:11.1f}{f / l:7.2f}{roof}")
    for key in ("pp_tok_s", "tg_tok_s"):
        print(f"{key} runs: ferrum {[r[key] for r in ours]}  llama.cpp {[r[key] for r in peer]}")


if __name__ == "__main__":
    main()
