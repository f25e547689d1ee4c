"""Decode attention on the CPU backend: 16 sequences x CTX keys (SmolLM2-135M's heads: 9 q / 3 kv,
head_dim 64, f16 KV, 16-token pool blocks scattered at random), one op per layer for 30 layers
recorded in one stream and replayed, as a decode step runs them. Prints microseconds per layer.

usage: python bench/attention_bench.py [--ctx 96] [--hot] [-t 2]
  --hot: every layer reads the same small pool (cache-resident); without it each layer has its own
         pool, so the keys come from DRAM as in the engine at 16 sequences.
"""
import argparse
import time

import numpy as np


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, default=96)
    ap.add_argument("--hot", action="store_true")
    ap.add_argument("-t", type=int, default=2)
    a = ap.parse_args()
    from ferrum import _core

    S, H, KV, hd, bs, layers = 16, 9, 3, 64, 16, 30
    be = _core.make_backend("cpu", a.t)
    rng = np.random.default_rng(0)
    per_seq = (a.ctx + bs - 1) // bs
    blocks = S * per_seq * (1 if a.hot else layers) + 8
    tables = rng.permutation(blocks)[:S * per_seq].reshape(S, per_seq).astype(np.int32)
    pools = []
    for _ in range(1 if a.hot else layers):
        k, v = (be.tensor(rng.standard_normal((blocks, KV, bs, hd)).astype(np.float16)) for _ in range(2))
        pools.append(_core.KvLayer(k, v))
    pos = a.ctx - 1
    slots = np.array([tables[s, pos // bs] * bs + pos % bs for s in range(S)], np.int32)
    batch = _core.AttnBatch(be.tensor(np.arange(S, dtype=np.int32)), be.tensor(np.full(S, pos, np.int32)),
                            be.tensor(slots), be.tensor(tables))
    params = _core.AttnParams(H, KV, hd, 1.0 / np.sqrt(hd), 0)
    q = be.tensor(rng.standard_normal((S, H, hd)).astype(np.float32))
    out = be.empty("f32", [S, H, hd])
    stream = be.stream()
    for layer in range(layers):
        be.paged_attention(q, pools[layer % len(pools)], batch, params, out, stream=stream)
    stream.submit()
    stream.sync()
    best = float("inf")
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(20):
            stream.submit()
            stream.sync()
        best = min(best, (time.perf_counter() - t0) / 20 / layers)
    print(f"{S} sequences x {a.ctx} keys, {'cache-resident' if a.hot else 'DRAM'} KV: "
          f"{best * 1e6:.1f} us per layer (best of 7)")


if __name__ == "__main__":
    main()
