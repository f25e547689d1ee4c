"""Serving-engine benchmark: aggregate generated tokens/s vs concurrency, and time to first token
with and without a cached 512-token prefix; llama.cpp's parallel sequences side by side.

usage: python bench/engine_bench.py [MODEL.gguf] [-c 1,2,4,8,16,32] [-p 64] [-n 64] [-t 2] [-r 3]
                                    [--no-peer] [-o bench/results/engine.json]

Throughput: c requests, each a distinct p-token window of a fixed English text, greedy, n tokens
each (EOS ignored), submitted together; aggregate = c * n / wall time from submission to the last
token (prefill included). Decode rate: the tokens generated after every request had its first
one, over the time since then (the prompts' prefill left out: what batching the decode steps
buys, which the aggregate mixes with c times the single stream's prefill work). ferrum and
llama.cpp run alternately in fresh processes (A B A B ...), r runs each; medians are reported.
llama.cpp runs through llama-cpp-python's low-level API (bench/llamacpp_parallel.py: one
llama_batch over c sequence ids per step, as llama.cpp's examples/batched does; the high-level
Llama class has a single sequence).
TTFT (ferrum only): a request whose 512-token prefix a previous request left in the prefix cache,
vs. one whose prefix is new; median of 5 each.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PEER_RUN = os.path.join(HERE, "..", "..", "shared", "bench", "llamacpp", "run.sh")
PEER_SCRIPT = os.path.join(HERE, "llamacpp_parallel.py")
TEXT = "/usr/share/common-licenses/GPL-3"


def text_tokens(tokenize):
    with open(TEXT, encoding="utf-8") as f:
        return tokenize(f.read())


def prompt_windows(ids, count, length, offset=0, stride=97):
    """`count` distinct windows of `length` tokens from `offset` (different first blocks: no
    prefix sharing). Offsets that differ by other than a multiple of the stride (97, a prime)
    never give the same window."""
    need = offset + (count - 1) * stride + length
    assert len(ids) >= need, f"the text has {len(ids)} tokens, {need} needed"
    return [ids[offset + i * stride:offset + i * stride + length] for i in range(count)]


# ---- ferrum worker (runs in a fresh process) ----

def ferrum_worker(a):
    sys.path.insert(0, os.path.join(HERE, "..", "python"))
    import ferrum
    llm = ferrum.LLM(a.model, num_threads=a.t)
    ids = text_tokens(llm.tokenizer.encode)
    greedy = ferrum.SamplingParams(max_tokens=a.n, temperature=0, ignore_eos=True)
    result = {"throughput": {}, "decode": {}}
    for level, c in enumerate(a.concurrency):
        # Each level its own windows: with the same ones, a level would find the previous
        # levels' prompts in the prefix cache (c = 16: half its prompts) and skip their prefill.
        prompts = prompt_windows(ids, c, a.p, offset=13 * level)
        # Warm-up with the same shapes (records the replayed streams), then the timed run.
        llm.generate(prompt_token_ids=prompt_windows(ids[4000:], c, a.p),
                     sampling_params=ferrum.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        result["throughput"][c], result["decode"][c] = timed_generate(llm, prompts, greedy, c * a.n)
    if a.ttft:
        result["ttft"] = ttft(llm, ids, ferrum)
    print(json.dumps(result))


def timed_generate(llm, prompts, params, expected):
    """Runs the prompts together through the incremental API (what generate() does); returns
    (generated tokens/s from submission to the last token, tokens/s after every request's first)."""
    hits_before = llm.stats()["prefix_hit_tokens"]
    t0 = time.perf_counter()
    for p in prompts:
        llm.add_request(p, params)
    started, generated = set(), 0
    decoding_since, generated_then = None, 0
    while llm.has_unfinished():
        for d in llm.step():
            n = sum(len(c.token_ids) for c in d.outputs)
            generated += n
            if n:
                started.add(d.request_id)
        if decoding_since is None and len(started) == len(prompts):
            decoding_since, generated_then = time.perf_counter(), generated
    t1 = time.perf_counter()
    assert generated == expected
    assert llm.stats()["prefix_hit_tokens"] == hits_before, "a timed prompt hit the prefix cache"
    return generated / (t1 - t0), (generated - generated_then) / (t1 - decoding_since)


def time_to_first_token(llm, prompt, params):
    t0 = time.perf_counter()
    rid = llm.add_request(prompt, params)
    while True:
        for d in llm.step():
            if d.request_id == rid and any(c.token_ids for c in d.outputs):
                elapsed = time.perf_counter() - t0
                while llm.has_unfinished():
                    llm.step()
                return elapsed


def ttft(llm, ids, ferrum, prefix_len=512, suffix_len=16, trials=5):
    one = ferrum.SamplingParams(max_tokens=1, temperature=0)
    miss, hit = [], []
    for k in range(trials):
        base = 2000 + k * (prefix_len + 2 * suffix_len)
        prefix = ids[base:base + prefix_len]
        s1 = ids[base + prefix_len:base + prefix_len + suffix_len]
        s2 = ids[base + prefix_len + suffix_len:base + prefix_len + 2 * suffix_len]
        before = llm.stats()["prefix_hit_tokens"]
        miss.append(time_to_first_token(llm, prefix + s1, one))  # new prefix: computed in full
        assert llm.stats()["prefix_hit_tokens"] == before
        hit.append(time_to_first_token(llm, prefix + s2, one))  # same prefix: its blocks are cached
        assert llm.stats()["prefix_hit_tokens"] - before == prefix_len
    return {"prefix_tokens": prefix_len, "suffix_tokens": suffix_len,
            "miss_s": statistics.median(miss), "hit_s": statistics.median(hit),
            "speedup": statistics.median(miss) / statistics.median(hit)}


# ---- orchestration ----

def run_json(cmd):
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{cmd[:3]} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def peer_python():
    """llama-cpp-python's interpreter, installed on first use by the shared run.sh."""
    d = os.environ.get("FERRUM_PEER_DIR", os.path.expanduser("~/.cache/ferrum-peer/llama-cpp-python"))
    py = os.path.join(d, "venv", "bin", "python")
    if not os.path.exists(py):
        subprocess.run(["bash", PEER_RUN, "--help"], capture_output=True)  # installs it
    return py if os.path.exists(py) else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("-c", "--concurrency", default="1,2,4,8,16,32")
    ap.add_argument("-p", type=int, default=64, help="prompt tokens per request")
    ap.add_argument("-n", type=int, default=64, help="generated tokens per request")
    ap.add_argument("-t", type=int, default=2, help="threads")
    ap.add_argument("-r", type=int, default=3, help="runs per engine (median)")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("-o", default=os.path.join(HERE, "results", "engine.json"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ttft", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.concurrency = [int(c) for c in str(a.concurrency).split(",")]
    if a.model is None:
        sys.path.insert(0, os.path.join(HERE, "..", "python"))
        from ferrum.models import default_model_path
        a.model = str(default_model_path())
    if a.worker:
        return ferrum_worker(a)

    common = [a.model, "-c", ",".join(map(str, a.concurrency)), "-p", str(a.p), "-n", str(a.n), "-t", str(a.t)]
    peer = None if a.no_peer else peer_python()
    ours, theirs, ttfts = [], [], []  # per run: {"throughput": {c: tok/s}, "decode": {c: tok/s}}
    for run in range(a.r):  # A B A B ... in fresh processes
        r = run_json([sys.executable] + (["-S"] if sys.flags.no_site else []) +
                     [os.path.abspath(__file__), "--worker"] + (["--ttft"] if run == 0 else []) + common)
        ours.append(r)
        if "ttft" in r:
            ttfts.append(r["ttft"])
        if peer:
            theirs.append(run_json([peer, PEER_SCRIPT] + common))
        print(f"run {run + 1}/{a.r} done", file=sys.stderr)

    def med(runs, key, c):
        return round(statistics.median(r[key][str(c)] if str(c) in r[key] else r[key][c] for r in runs), 2)

    table = []
    for c in a.concurrency:
        row = {"concurrency": c, "ferrum_tok_s": med(ours, "throughput", c),
               "ferrum_decode_tok_s": med(ours, "decode", c)}
        if theirs:
            row["llamacpp_tok_s"] = med(theirs, "throughput", c)
            row["llamacpp_decode_tok_s"] = med(theirs, "decode", c)
        table.append(row)
    first = table[0] if a.concurrency[0] == 1 else None
    for row in table:
        if first:
            row["ferrum_speedup_vs_1"] = round(row["ferrum_tok_s"] / first["ferrum_tok_s"], 2)
            row["ferrum_decode_speedup_vs_1"] = round(row["ferrum_decode_tok_s"] / first["ferrum_decode_tok_s"], 2)
        if "llamacpp_tok_s" in row:
            row["ratio_ferrum_over_llamacpp"] = round(row["ferrum_tok_s"] / row["llamacpp_tok_s"], 2)
            row["decode_ratio_ferrum_over_llamacpp"] = round(row["ferrum_decode_tok_s"] / row["llamacpp_decode_tok_s"], 2)
    result = {
        "model": os.path.basename(a.model), "threads": a.t, "prompt_tokens": a.p, "generated_tokens": a.n,
        "runs": a.r, "statistic": "median", "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg()[0],
        "throughput": table, "ttft": ttfts[0] if ttfts else None,
        "peer": "llama.cpp via llama-cpp-python low-level batch API" if theirs else None,
    }
    os.makedirs(os.path.dirname(a.o), exist_ok=True)
    with open(a.o, "w") as f:
        json.dump(result, f, indent=2)
    print(f"model {result['model']}, {a.t} threads, prompt {a.p}, generate {a.n}; median of {a.r}")
    nan = float("nan")
    print(f"{'':>5}{'with prefill (tok/s)':^34}|{'decode phase (tok/s)':^34}")
    print(f"{'conc':>5}{'ferrum':>9}{'x vs 1':>8}{'llama.cpp':>10}{'ratio':>7} |{'ferrum':>8}{'x vs 1':>8}"
          f"{'llama.cpp':>10}{'ratio':>7}")
    for row in table:
        print(f"{row['concurrency']:>5}{row['ferrum_tok_s']:>9.1f}{row.get('ferrum_speedup_vs_1', nan):>8.2f}"
              f"{row.get('llamacpp_tok_s', nan):>10.1f}{row.get('ratio_ferrum_over_llamacpp', nan):>7.2f} |"
              f"{row['ferrum_decode_tok_s']:>8.1f}{row.get('ferrum_decode_speedup_vs_1', nan):>8.2f}"
              f"{row.get('llamacpp_decode_tok_s', nan):>10.1f}{row.get('decode_ratio_ferrum_over_llamacpp', nan):>7.2f}")
    if result["ttft"]:
        t = result["ttft"]
        print(f"TTFT with a {t['prefix_tokens']}-token prefix: miss {t['miss_s'] * 1000:.1f} ms, "
              f"hit {t['hit_s'] * 1000:.1f} ms ({t['speedup']:.1f}x)")
    print(f"wrote {a.o}")


if __name__ == "__main__":
    main()
