"""`ferrum bench`: llama-bench-style prompt processing (pp) and generation (tg) tokens/s."""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

import numpy as np


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        return int(f.read().split(field + ":")[1].split()[0]) / 1024


def _rss_mib() -> float:
    return _status_mib("VmRSS")


def _peak_rss_mib() -> float:
    # VmHWM, not getrusage's ru_maxrss: that one survives fork + exec, so a child of a big
    # parent (a benchmark driver) would report the parent's peak.
    return _status_mib("VmHWM")


def _model_bytes(path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) if path.is_dir() else path.stat().st_size


def run_bench(args) -> dict:
    from . import _core
    from .models import resolve_model
    path = resolve_model(args.model_path)
    threads = args.threads or os.cpu_count()  # None: all cores, as the runner takes them
    base_rss = _rss_mib()  # the interpreter, numpy and the extension: not the model's
    runner = _core.ModelRunner(str(path), device=args.device, num_threads=threads,
                               max_model_len=max(1024, args.n_prompt + args.n_gen + 16),
                               kv_cache_tokens=args.n_prompt + args.n_gen + 64, prefix_cache=False)
    # One sequence through the engine: the prompt in one forward, then one token a step (greedy).
    engine = _core.Engine(runner, max_num_seqs=1, max_num_batched_tokens=args.n_prompt)
    vocab = runner.config["vocab_size"]
    prompt = [int(t) for t in np.random.default_rng(0).integers(1, vocab, args.n_prompt)]
    pp_times, tg_times = [], []
    for rep in range(args.repetitions):
        _progress(f"run {rep + 1}/{args.repetitions}: pp{args.n_prompt}")
        seq = engine.add_sequence(prompt)
        t0 = time.perf_counter()
        tok = int(engine.step()["logits"][0].argmax())
        pp_times.append(time.perf_counter() - t0)
        _progress(f"run {rep + 1}/{args.repetitions}: tg{args.n_gen}")
        t0 = time.perf_counter()
        for _ in range(args.n_gen):
            engine.commit([seq], [tok], [False])
            tok = int(engine.step()["logits"][0].argmax())
        tg_times.append(time.perf_counter() - t0)
        engine.abort(seq)
    _progress(None)
    pp, tg = min(pp_times), min(tg_times)
    # The engine's memory (peak over load and generation, less the interpreter) against the
    # bound weights file + KV pool + 15%; the tokenizer is loaded after and reported apart.
    c, st = runner.config, runner.stats()
    kv_mib = (st["kv_blocks_total"] * st["block_size"] * c["num_layers"] * 2 * c["num_kv_heads"] *
              c["head_dim"] * 2) / 2**20  # f16 KV, the default
    file_mib = _model_bytes(path) / 2**20
    engine_rss = _peak_rss_mib() - base_rss
    memory = {"peak_rss_mib": round(_peak_rss_mib(), 1), "engine_rss_mib": round(engine_rss, 1),
              "file_mib": round(file_mib, 1), "kv_mib": round(kv_mib, 1),
              "engine_rss_vs_bound": round(engine_rss / (1.15 * (file_mib + kv_mib)), 3)}
    tok_rss = _rss_mib()
    try:
        tokenize = _tokenizer_times(path)
    except ValueError:  # a weights-only file: no tokenizer to time
        tokenize = {"encode_us_per_tok": None, "decode_us_per_tok": None}
    result = {"engine": "ferrum", "model": str(path), "device": args.device, "threads": threads,
              "n_prompt": args.n_prompt, "n_gen": args.n_gen, "repetitions": args.repetitions,
              "pp_tok_s": round(args.n_prompt / pp, 2), "tg_tok_s": round(args.n_gen / tg, 2),
              **_rate_stats("pp", args.n_prompt, pp_times), **_rate_stats("tg", args.n_gen, tg_times),
              **memory, "tokenizer_rss_mib": round(_rss_mib() - tok_rss, 1), **tokenize}
    # Tokenizing must never dominate: its cost per token as a share of the model's.
    if tokenize["encode_us_per_tok"] is not None:
        result["encode_vs_pp"] = round(tokenize["encode_us_per_tok"] * 1e-6 * args.n_prompt / pp, 4)
        result["decode_vs_tg"] = round(tokenize["decode_us_per_tok"] * 1e-6 * args.n_gen / tg, 4)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"model: {path.name}  device: {args.device}  threads: {threads}  runs: {args.repetitions}")
        for test, n in (("pp", args.n_prompt), ("tg", args.n_gen)):
            print(f"{test}{n}: best {result[f'{test}_tok_s']:.2f} tok/s   "
                  f"mean {result[f'{test}_tok_s_mean']:.2f} +- {result[f'{test}_tok_s_sd']:.2f} tok/s")
        print(f"peak RSS: {result['peak_rss_mib']} MiB")
        print(f"engine memory: {result['engine_rss_mib']} MiB = {100 * result['engine_rss_vs_bound']:.0f}% of "
              f"(file {result['file_mib']} MiB + KV {result['kv_mib']} MiB) + 15%; "
              f"tokenizer {result['tokenizer_rss_mib']} MiB more")
        if "encode_vs_pp" in result:
            print(f"tokenizer: encode {result['encode_us_per_tok']:.2f} us/tok ({100 * result['encode_vs_pp']:.2f}% of pp), "
                  f"streaming decode {result['decode_us_per_tok']:.2f} us/tok ({100 * result['decode_vs_tg']:.2f}% of tg)")
    return result


def _rate_stats(test: str, tokens: int, seconds) -> dict:
    """Mean and sample standard deviation of the runs' tokens/s (llama-bench's avg +- stdev)."""
    rates = [tokens / s for s in seconds]
    sd = statistics.stdev(rates) if len(rates) > 1 else 0.0
    return {f"{test}_tok_s_mean": round(statistics.fmean(rates), 2), f"{test}_tok_s_sd": round(sd, 2)}


def _progress(what) -> None:
    """Which run is going on, on one line of stderr when it is a terminal; None clears the line."""
    if not sys.stderr.isatty():
        return
    sys.stderr.write("\r\033[K" + (f"bench: {what}" if what else ""))
    sys.stderr.flush()


# English prose for the tokenizer timing (repeated to a few thousand tokens).
_TEXT = ("The quick brown fox jumps over the lazy dog while the committee, after much deliberation, "
         "decided that 42 apples and 3.5 litres of cider were enough for everyone's picnic. ")


def _tokenizer_times(path) -> dict:
    """Encode and streaming-decode cost per token with the model's own tokenizer."""
    from . import _core
    from .llm import _load_tokenizer
    from .tokenizer import IncrementalDecoder
    tok = _load_tokenizer(path, _core.ModelFile(str(path)), None)
    text = _TEXT * 40
    t0 = time.perf_counter()
    ids = tok.encode(text)
    encode = (time.perf_counter() - t0) / len(ids)
    dec = IncrementalDecoder(tok)
    t0 = time.perf_counter()
    for t in ids:  # one token at a time, as a stream delivers them
        dec.push(t)
    dec.flush()
    decode = (time.perf_counter() - t0) / len(ids)
    return {"encode_us_per_tok": round(encode * 1e6, 3), "decode_us_per_tok": round(decode * 1e6, 3)}
