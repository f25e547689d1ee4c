"""Decode against a plain read of the same bytes, interleaved in one process: the share of the
memory bandwidth of the moment that a decode streams.

This VM's read bandwidth switches between two phases (~33 and 55-60 GB/s) every few seconds, for
every buffer at once (a buffer kept for a minute and a fresh one switch together), so readings
taken before and after a `ferrum bench` run can miss what the run met. Here blocks of decode steps
(~50 ms) alternate with plain reads of as many bytes (torch sum, the same number of threads), and
each decode block is set against the reads on both sides of it when those two agree (within 15%).

usage: python bench/interleaved_share.py MODEL [MODEL ...] [-b 80] [-t 2]
"""
import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # torch's threads must not spin into the decode
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from perf_table import bytes_per_token  # noqa: E402

FAST_GBS = 45.0  # a read above this is the fast phase


def share(model, blocks, threads):
    import numpy as np
    import torch
    from ferrum import _core
    torch.set_num_threads(threads)
    per_token = bytes_per_token(model)
    buf = torch.ones(int(per_token) // 4, dtype=torch.float32)  # one token's bytes
    runner = _core.ModelRunner(model, device="cpu", num_threads=threads, max_model_len=1024,
                               kv_cache_tokens=512, prefix_cache=False)
    prompt = [int(t) for t in np.random.default_rng(0).integers(1, runner.config["vocab_size"], 16)]
    state = {"seq": None, "ctx": 0, "tok": 0}

    def decode(k):
        if state["seq"] is None or state["ctx"] + k > 400:
            if state["seq"] is not None:
                runner.release_sequence(state["seq"])
            state["seq"] = runner.add_sequence()
            state["tok"] = int(runner.step([(state["seq"], prompt, "last")])[0].argmax())
            state["ctx"] = 16
        t0 = time.perf_counter()
        for _ in range(k):
            state["tok"] = int(runner.step([(state["seq"], [state["tok"]], "last")])[0].argmax())
        state["ctx"] += k
        return k * per_token / (time.perf_counter() - t0) / 1e9

    def read(k):
        t0 = time.perf_counter()
        for _ in range(k):
            buf.sum()
        return k * per_token / (time.perf_counter() - t0) / 1e9

    decode(8)
    read(4)  # warm both
    k = max(4, int(0.05 * decode(8) * 1e9 / per_token))  # ~50 ms of decode per block
    reads, decodes = [read(k)], []
    for _ in range(blocks):
        decodes.append(decode(k))
        reads.append(read(k))
    pairs = [(d, (a + b) / 2) for d, a, b in zip(decodes, reads, reads[1:]) if abs(a - b) <= 0.15 * max(a, b)]
    return k, pairs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("-b", type=int, default=80, help="decode blocks per model")
    ap.add_argument("-t", type=int, default=2)
    a = ap.parse_args()
    print("model | steps a block | phase: pairs, read GB/s, decode GB/s, share (median; quartiles)")
    for model in a.models:
        k, pairs = share(os.path.expanduser(model), a.b, a.t)
        parts = []
        for name, sel in (("slow", [p for p in pairs if p[1] < FAST_GBS]), ("fast", [p for p in pairs if p[1] >= FAST_GBS])):
            if not sel:
                parts.append(f"{name}: none")
                continue
            shares = sorted(d / r for d, r in sel)
            q = lambda f: shares[min(len(shares) - 1, int(f * len(shares)))]  # noqa: E731
            parts.append(f"{name}: {len(sel)}, {statistics.median(r for _, r in sel):.1f}, "
                         f"{statistics.median(d for d, _ in sel):.1f}, {statistics.median(shares):.2f} "
                         f"({q(0.25):.2f}-{q(0.75):.2f})")
        print(f"{os.path.basename(model.rstrip('/'))} | {k} | " + " | ".join(parts), flush=True)


if __name__ == "__main__":
    main()
