"""llama.cpp with parallel sequences, for bench/engine_bench.py (run with llama-cpp-python's own
interpreter). llama-cpp-python's high-level Llama class drives a single sequence, so this uses
its low-level API the way llama.cpp's examples/batched does: every prompt goes into one
llama_batch under its own sequence id, then each step decodes one batch holding the next token
of every sequence. Greedy (argmax of each row's logits).

usage: python llamacpp_parallel.py MODEL.gguf -c 1,2,4 -p 64 -n 64 -t 2
Prints one JSON line: {"throughput": {concurrency: generated tokens/s}, "decode": {concurrency:
tokens/s generated after every sequence's first token}}.
"""
import argparse
import ctypes
import json
import time

import llama_cpp as L
import numpy as np

TEXT = "/usr/share/common-licenses/GPL-3"
_QUIET = L.llama_log_callback(lambda level, text, data: None)  # kept alive: llama.cpp holds it


def tokenize(vocab, text):
    raw = text.encode()
    buf = (L.llama_token * (len(raw) + 16))()
    n = L.llama_tokenize(vocab, raw, len(raw), buf, len(buf), False, False)
    assert n >= 0
    return list(buf[:n])


class Batch:
    def __init__(self, capacity, seqs):
        self.b = L.llama_batch_init(capacity, 0, seqs)

    def fill(self, entries):
        """entries: (token, position, sequence, wants_logits)."""
        b = self.b
        for i, (tok, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(entries)

    def free(self):
        L.llama_batch_free(self.b)


def generate(ctx, n_vocab, prompts, n_gen):
    """Greedy-generates n_gen tokens for every prompt in parallel; returns the tokens and the
    time when every sequence had its first one (the prompts' prefill done)."""
    L.llama_memory_clear(L.llama_get_memory(ctx), True)
    c = len(prompts)
    batch = Batch(max(sum(map(len, prompts)), c), c)
    entries, rows = [], []
    for s, p in enumerate(prompts):
        for j, tok in enumerate(p):
            entries.append((tok, j, s, j == len(p) - 1))
        rows.append(len(entries) - 1)
    batch.fill(entries)
    assert L.llama_decode(ctx, batch.b) == 0
    out = [[] for _ in prompts]
    pos = [len(p) for p in prompts]
    for step in range(n_gen):
        nxt = []
        for s, row in enumerate(rows):
            logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, row), shape=(n_vocab,))
            nxt.append(int(logits.argmax()))
            out[s].append(nxt[-1])
        if step == 0:  # every sequence has its first token; the decode steps start here
            decoding_since = time.perf_counter()
        if step == n_gen - 1:
            break
        batch.fill([(nxt[s], pos[s], s, True) for s in range(c)])
        pos = [x + 1 for x in pos]
        rows = list(range(c))
        assert L.llama_decode(ctx, batch.b) == 0
    batch.free()
    return out, decoding_since


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("-c", "--concurrency", default="1,2,4,8,16,32")
    ap.add_argument("-p", type=int, default=64)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-t", type=int, default=2)
    a = ap.parse_args()
    conc = [int(c) for c in a.concurrency.split(",")]
    L.llama_backend_init()
    L.llama_log_set(_QUIET, None)
    model = L.llama_model_load_from_file(a.model.encode(), L.llama_model_default_params())
    vocab = L.llama_model_get_vocab(model)
    n_vocab = L.llama_vocab_n_tokens(vocab)
    ids = tokenize(vocab, open(TEXT, encoding="utf-8").read())
    result, decode = {}, {}
    for c in conc:
        cp = L.llama_context_default_params()
        cp.n_ctx = c * (a.p + a.n) + 64
        cp.n_batch = max(512, c * a.p)
        cp.n_seq_max = c
        cp.n_threads = cp.n_threads_batch = a.t
        cp.kv_unified = True
        ctx = L.llama_init_from_model(model, cp)
        windows = lambda off: [ids[off + i * 97:off + i * 97 + a.p] for i in range(c)]
        generate(ctx, n_vocab, windows(4000), 4)  # warm-up
        t0 = time.perf_counter()
        out, decoding_since = generate(ctx, n_vocab, windows(0), a.n)
        t1 = time.perf_counter()
        result[c] = sum(map(len, out)) / (t1 - t0)
        decode[c] = c * (a.n - 1) / (t1 - decoding_since)
        L.llama_free(ctx)
    L.llama_model_free(model)
    print(json.dumps({"throughput": result, "decode": decode}))


if __name__ == "__main__":
    main()
