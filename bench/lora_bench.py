"""LoRA serving (docs/lora.md): what adapters cost a step, against the base and against llama.cpp.

usage: python bench/lora_bench.py [-p 128] [-n 64] [-r 2] [--requests 8] [--threads 2]
                                  [--no-peer] [--data-dir ~/.cache/ferrum-bench] [-o bench/results/lora.json]
The base is TinyLlama-1.1B's shape with random weights in Q4_K_M (bench/tp_bench.py writes it);
the adapters are rank-16 PEFT adapters on all seven projections, made by PEFT itself
(ferrum.tools.make_lora) on the same shape's HF directory and stored in f16, written once into
--data-dir; llama.cpp's copy of the first is converted by its own convert_lora_to_gguf.py (f16).

In one ferrum process (enable_lora, max_loras = requests), alternating rounds, the best of -r:
- one stream: pp (a -p token prompt to its first token) and tg (the -n tokens after it), on the
  base and with an adapter;
- `--requests` concurrent requests of -n tokens each: aggregate generated tokens/s on the base,
  each on its own adapter, and all on one shared adapter;
- the time to load an adapter (first use) and the resident memory each loaded adapter adds.
llama.cpp (llama-cpp-python, the build ../shared/bench/llamacpp/run.sh makes) runs the same
base and the GGUF adapter through bench/llamacpp_lora.py in its own interpreter, one stream, a
round of it after each of ferrum's, so that both meet the machine's read bandwidth of the same
minutes (on a shared host it drifts by a fifth), the best of -r.
"""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import tp_bench  # noqa: E402  (the base model)
from engine_bench import peer_python  # noqa: E402

RANK = 16


def make_files(data_dir, count):
    """The base GGUF, its HF twin (for PEFT and the converter), `count` f16 PEFT adapters and the
    first one as a llama.cpp GGUF adapter."""
    sys.path.insert(0, os.path.join(HERE, "..", "python"))
    from ferrum.tools.make_model import make_model
    data_dir = os.path.expanduser(data_dir)
    base = tp_bench.default_model(data_dir)
    hf = os.path.join(data_dir, "tinyllama-1.1b-hf-f16")
    if not os.path.exists(os.path.join(hf, "config.json")):
        make_model("llama", "tinyllama-1.1b", "hf", "f16", seed=0, out=hf + ".part")
        os.replace(hf + ".part", hf)
    adapters = [os.path.join(data_dir, f"tinyllama-lora-r{RANK}-f16-{i}") for i in range(count)]
    for i, path in enumerate(adapters):
        if not os.path.exists(os.path.join(path, "adapter_model.safetensors")):
            make_adapter(hf, path, seed=i)
    gguf = adapters[0] + ".gguf"
    if not os.path.exists(gguf):
        from ferrum.tools.lora_to_gguf import convert
        part = adapters[0] + ".part.gguf"
        convert(adapters[0], base=hf, out=part, outtype="f16")
        os.replace(part, gguf)
    return base, adapters, gguf


def make_adapter(hf, path, seed):
    """A PEFT adapter of rank RANK on all seven projections, its tensors stored in f16 (as an
    adapter trained in half precision is saved)."""
    import torch
    from safetensors.torch import load_file, save_file
    from ferrum.tools.make_lora import make_lora
    make_lora(hf, path + ".part", r=RANK, lora_alpha=2 * RANK, seed=seed)
    st = os.path.join(path + ".part", "adapter_model.safetensors")
    save_file({k: v.to(torch.float16).contiguous() for k, v in load_file(st).items()}, st,
              metadata={"format": "pt"})
    os.replace(path + ".part", path)


def stream_prompt(vocab, p):
    """The one stream's prompt: BOS and p - 1 ids spread over the vocabulary."""
    return [1] + [100 + (13 * i) % (vocab - 200) for i in range(p - 1)]


def one_stream(llm, prompt, n, lora):
    """(pp tok/s, tg tok/s) of one greedy request."""
    import ferrum
    params = ferrum.SamplingParams(max_tokens=n + 1, temperature=0, ignore_eos=True)
    rid = llm.add_request(prompt, params, lora_request=lora)
    t0, t_first, tokens = time.perf_counter(), None, 0
    while llm.has_unfinished():
        for d in llm.step():
            if d.request_id == rid:
                tokens += sum(len(c.token_ids) for c in d.outputs)
        if t_first is None and tokens:
            t_first = time.perf_counter()
    t_end = time.perf_counter()
    return len(prompt) / (t_first - t0), (tokens - 1) / (t_end - t_first)


def concurrent(llm, prompts, n, loras):
    """Aggregate generated tokens/s of the prompts run together, each with its adapter."""
    import ferrum
    params = ferrum.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, lora_request=loras)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def ferrum_figures(args, base, adapters, after_round):
    import ferrum
    from ferrum import LoRARequest
    from ferrum.bench import _rss_mib as rss_mib
    count = len(adapters)
    llm = ferrum.LLM(base, num_threads=args.threads, enable_lora=True, max_loras=count,
                     max_lora_rank=RANK, max_cpu_loras=count, max_num_seqs=count,
                     enable_prefix_caching=False, kv_cache_tokens=count * (args.p + args.n + 32))
    requests = [LoRARequest(f"lora{i}", i + 1, path) for i, path in enumerate(adapters)]
    before = rss_mib()
    t0 = time.perf_counter()
    llm.add_lora(requests[0])
    load_s = time.perf_counter() - t0
    for r in requests[1:]:
        llm.add_lora(r)
    per_adapter_mib = (rss_mib() - before) / count
    vocab = llm.config["vocab_size"]
    prompt = stream_prompt(vocab, args.p)
    prompts = [[1] + [100 + (7 * r + 3 * i) % (vocab - 200) for i in range(31)] for r in range(count)]
    llm.generate(prompt_token_ids=prompts[:2], sampling_params=ferrum.SamplingParams(max_tokens=2))
    runs = {k: [] for k in ("base", "adapter")}
    many = {k: [] for k in ("base", "different adapters", "one shared adapter")}
    for _ in range(args.r):
        runs["base"].append(one_stream(llm, prompt, args.n, None))
        runs["adapter"].append(one_stream(llm, prompt, args.n, requests[0]))
        many["base"].append(concurrent(llm, prompts, args.n, None))
        many["different adapters"].append(concurrent(llm, prompts, args.n, requests))
        many["one shared adapter"].append(concurrent(llm, prompts, args.n, requests[0]))
        after_round()
    return {"one_stream": {k: {"pp_tok_s": max(p for p, _ in v), "tg_tok_s": max(t for _, t in v)}
                           for k, v in runs.items()},
            "concurrent_tok_s": {k: max(v) for k, v in many.items()},
            "adapter_load_s": load_s, "adapter_resident_mib": per_adapter_mib,
            "adapter_file_mib": os.path.getsize(os.path.join(adapters[0], "adapter_model.safetensors")) / 2**20}


def peer_round(py, args, base, gguf):
    """One llama.cpp round: {"base" | "adapter": {"pp_tok_s", "tg_tok_s"}}."""
    out = {}
    for name, lora in (("base", []), ("adapter", [gguf])):
        cmd = [py, os.path.join(HERE, "llamacpp_lora.py"), base, str(args.p), str(args.n), str(args.threads)] + lora
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if res.returncode != 0:
            raise SystemExit(f"llama.cpp failed:\n{res.stderr[-2000:]}")
        out[name] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


def best_of(rounds):
    """Each figure's best over the rounds (None without rounds)."""
    if not rounds:
        return None
    return {k: {m: max(r[k][m] for r in rounds) for m in ("pp_tok_s", "tg_tok_s")} for k in rounds[0]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-p", type=int, default=128, help="prompt tokens of the one stream")
    ap.add_argument("-n", type=int, default=64, help="generated tokens per request")
    ap.add_argument("-r", type=int, default=2, help="alternating rounds (the best is reported)")
    ap.add_argument("--requests", type=int, default=8, help="concurrent requests (and adapters)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--data-dir", default="~/.cache/ferrum-bench")
    ap.add_argument("-o", default=os.path.join(HERE, "results", "lora.json"))
    args = ap.parse_args()
    base, adapters, gguf = make_files(args.data_dir, args.requests)
    load_before = os.getloadavg()[0]
    py = None if args.no_peer else peer_python()
    peer_rounds = []
    ours = ferrum_figures(args, base, adapters,
                          lambda: py and peer_rounds.append(peer_round(py, args, base, gguf)))
    peer = best_of(peer_rounds)
    result = {"model": base, "rank": RANK, "threads": args.threads, "p": args.p, "n": args.n,
              "requests": args.requests, "loadavg": [load_before, os.getloadavg()[0]],
              "ferrum": ours, "llama.cpp": peer}
    os.makedirs(os.path.dirname(args.o), exist_ok=True)
    with open(args.o, "w") as f:
        json.dump(result, f, indent=1)
    print(report(result))


def report(r):
    f = r["ferrum"]
    one, many = f["one_stream"], f["concurrent_tok_s"]
    lines = [f"TinyLlama-1.1B shape Q4_K_M, rank-{r['rank']} f16 adapters on all seven projections, "
             f"{r['threads']} threads, load average {r['loadavg'][0]:.1f} -> {r['loadavg'][1]:.1f}", "",
             "| one stream | pp tok/s | tg tok/s |", "|---|---|---|"]
    for k, v in one.items():
        lines.append(f"| ferrum, {k} | {v['pp_tok_s']:.1f} | {v['tg_tok_s']:.1f} |")
    peer = r["llama.cpp"]
    if peer:
        for k, v in peer.items():
            lines.append(f"| llama.cpp, {k} | {v['pp_tok_s']:.1f} | {v['tg_tok_s']:.1f} |")
    lines += ["", f"adapter / base, one stream: tg {one['adapter']['tg_tok_s'] / one['base']['tg_tok_s']:.2f}x, "
              f"pp {one['adapter']['pp_tok_s'] / one['base']['pp_tok_s']:.2f}x"]
    if peer:
        lines.append(f"ferrum / llama.cpp with the adapter: tg {one['adapter']['tg_tok_s'] / peer['adapter']['tg_tok_s']:.2f}x, "
                     f"pp {one['adapter']['pp_tok_s'] / peer['adapter']['pp_tok_s']:.2f}x")
    lines += ["", f"| {r['requests']} concurrent requests | tok/s | vs base |", "|---|---|---|"]
    for k, v in many.items():
        lines.append(f"| {k} | {v:.1f} | {v / many['base']:.2f}x |")
    lines += ["", f"adapter load (first use): {1e3 * f['adapter_load_s']:.0f} ms; resident per loaded adapter "
              f"{f['adapter_resident_mib']:.1f} MiB (file {f['adapter_file_mib']:.1f} MiB)"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
