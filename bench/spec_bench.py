"""Speculative decoding: single-stream decode tokens/s with and without it, side by side.

usage: python bench/spec_bench.py [--what lookup|draft|steps|ceiling|all] [-n 128] [-t 2] [-r 3] [-k 5] [--ignore-eos]
                                  [--out FILE.json]

- lookup: prompt lookup (ngram) on SmolLM2-135M-Instruct Q4_1, on prompts with repeated spans
  and on prompts with nothing to look up (bench/spec_prompts.json), against the same model
  without speculation, and against llama.cpp's prompt lookup (LlamaPromptLookupDecoding, in the
  peer's own venv) with and without it.
- draft: the model's F16 requantization as the target, the Q4_1 file as its draft, on chat
  prompts; reports the effective bandwidth (target bytes a token x tokens/s) against a plain
  read of memory, i.e. how far past the decode roof it gets.
- steps (not in all): what a step verifying k proposals costs against a decode step, for the
  Q4_1 model and the F16 target, the steps interleaved in one process.
- ceiling (not in all): prompt lookup's best case on these prompts at those step costs: the
  proposer replayed over each greedy answer, a step costing what its rows cost and nothing more.

Every prompt is greedy, chat-templated, up to `-n` tokens, ending at the model's end of turn as a
user's request does (`--ignore-eos`: always `-n`, running on past the answer); decode tokens/s
counts from the first generated token to the last. Runs alternate (plain, speculative, plain,
...) in one process so both meet the same memory phases; outputs are checked equal token for
token.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PEER_VENV = os.path.join(os.environ.get("FERRUM_PEER_DIR", os.path.expanduser("~/.cache/ferrum-peer/llama-cpp-python")),
                         "venv", "bin", "python")
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def chat_ids(chat, text):
    """A user message's prompt ids under the tokenizer's chat template."""
    return chat.encode(chat.apply_chat_template([{"role": "user", "content": text}]))


def decode_rate(llm, prompt_ids, n, ignore_eos=False):
    """Decode tokens/s of one greedy request of up to n tokens (from its first token to its last),
    its tokens and the steps that decoded them."""
    import ferrum
    rid = llm.add_request(prompt_ids, ferrum.SamplingParams(max_tokens=n, temperature=0, ignore_eos=ignore_eos))
    first, steps = None, 0
    while llm.has_unfinished():
        deltas = llm.step()
        steps += first is not None
        for d in deltas:
            if first is None and d.outputs and d.outputs[0].token_ids:
                first = (time.perf_counter(), len(d.outputs[0].token_ids))
            if d.finished:
                done, out = time.perf_counter(), d.output.outputs[0].token_ids
    assert d.request_id == rid
    return (len(out) - first[1]) / (done - first[0]), out, steps


def side_by_side(plain, spec, prompts, n, reps, chat=None, ignore_eos=False):
    """`chat`: the tokenizer whose chat template renders the prompts (default: plain's)."""
    chat = chat or plain.tokenizer
    rows = []
    for text in prompts:
        ids = chat_ids(chat, text)
        rates = {"plain": [], "spec": []}
        outs, steps = {}, {}
        before = spec.stats()
        for _ in range(reps):
            for name, llm in (("plain", plain), ("spec", spec)):
                rate, outs[name], steps[name] = decode_rate(llm, ids, n, ignore_eos)
                rates[name].append(rate)
        rows.append({"prompt": text[:60], "prompt_ids": ids, "plain_tok_s": statistics.median(rates["plain"]),
                     "spec_tok_s": statistics.median(rates["spec"]), "equal": outs["plain"] == outs["spec"],
                     "tokens": len(outs["spec"]), "tokens_per_step": (len(outs["spec"]) - 1) / max(steps["spec"], 1),
                     "acceptance_rate": accepted_share(before, spec.stats())})
        rows[-1]["speedup"] = rows[-1]["spec_tok_s"] / rows[-1]["plain_tok_s"]
    return rows


def accepted_share(before, after):
    """The share of proposals accepted between two stats() snapshots."""
    proposed = after["spec_proposed_tokens"] - before["spec_proposed_tokens"]
    return (after["spec_accepted_tokens"] - before["spec_accepted_tokens"]) / proposed if proposed else 0.0


def llamacpp_lookup(model, rows, n, threads, ignore_eos):
    """llama.cpp's decode tokens/s without and with LlamaPromptLookupDecoding on the same prompt ids."""
    script = os.path.join(HERE, "llamacpp_lookup.py")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([r["prompt_ids"] for r in rows], f)
    out = subprocess.run([PEER_VENV, script, model, f.name, str(n), str(threads)] + ["--ignore-eos"] * ignore_eos,
                         capture_output=True, text=True, check=True).stdout
    os.unlink(f.name)
    for r, peer in zip(rows, json.loads(out.strip().splitlines()[-1])):
        r.update({"llamacpp_tok_s": peer["plain"], "llamacpp_lookup_tok_s": peer["lookup"]})


def summary(name, rows):
    geo = lambda xs: statistics.geometric_mean(xs)
    line = {"set": name, "speedup_geomean": geo([r["speedup"] for r in rows]),
            "all_equal": all(r["equal"] for r in rows),
            "plain_tok_s": geo([r["plain_tok_s"] for r in rows]), "spec_tok_s": geo([r["spec_tok_s"] for r in rows]),
            "acceptance_rate": statistics.mean(r["acceptance_rate"] for r in rows),
            "tokens_per_step": statistics.mean(r["tokens_per_step"] for r in rows)}
    if "llamacpp_tok_s" in rows[0]:
        line["llamacpp_tok_s"] = geo([r["llamacpp_tok_s"] for r in rows])
        line["llamacpp_lookup_tok_s"] = geo([r["llamacpp_lookup_tok_s"] for r in rows])
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in line.items()}))
    return line


def verify_step_costs(model, threads, rows=(1, 2, 4, 6, 8), reps=16):
    """Engine steps of one sequence (200 tokens of context) computing 1 + k tokens (its last
    token and k proposals), interleaved; the median of each, and its cost in decode steps."""
    from ferrum import _core
    runner = _core.ModelRunner(model, device="cpu", num_threads=threads, max_model_len=2048, kv_cache_tokens=4096)
    engine = _core.Engine(runner, max_num_seqs=4, max_num_batched_tokens=512)
    seq = engine.add_sequence(list(range(100, 300)))
    engine.step()
    times = {r: [] for r in rows}
    for _ in range(reps):
        for r in rows:
            # a token and r - 1 proposals after the prompt (the previous round's rejected), then
            # one accepted token, so each round starts from the same context
            engine.commit([seq], [500], [False], [0], [list(range(501, 500 + r))])
            start = time.perf_counter()
            out = engine.step()
            times[r].append(time.perf_counter() - start)
            assert len(out["seqs"]) == r
            engine.commit([seq], [1], [False], [0], [])
            engine.step()
    decode = statistics.median(times[rows[0]])
    return {r: {"ms": 1e3 * statistics.median(t), "decode_steps": statistics.median(t) / decode} for r, t in times.items()}


def lookup_ceiling(llm, chat, prompts, n, costs, k):
    """What prompt lookup can reach on these prompts' answers when a step costs only what its
    rows cost: each answer generated once, the proposer (the engine's own NgramIndex and k
    adaptation) replayed over it, a step of r rows costing costs[r] decode steps and nothing
    else (no sampling, no host work). Per prompt: tokens per step and the speedup."""
    import ferrum
    from ferrum.speculative import NgramIndex, Speculation
    rows = []
    for text in prompts:
        ids = chat_ids(chat, text)
        answer = llm.generate(prompt_token_ids=[ids], sampling_params=ferrum.SamplingParams(
            max_tokens=n, temperature=0))[0].outputs[0].token_ids
        index, spec = NgramIndex(NGRAM["prompt_lookup_min"], NGRAM["prompt_lookup_max"]), Speculation(k)
        done, steps, cost = 1, 0, 0.0  # the first token comes from the prompt's step
        while done < len(answer):
            index.follow(ids, answer[:done])
            draft = index.propose(min(spec.k, len(answer) - done))
            accepted = 0
            while accepted < len(draft) and draft[accepted] == answer[done + accepted]:
                accepted += 1
            spec.adapt(len(draft), accepted, k)
            done += accepted + 1
            steps += 1
            cost += costs[1 + len(draft)]["decode_steps"]
        rows.append({"prompt": text[:60], "tokens_per_step": (len(answer) - 1) / steps,
                     "speedup": (len(answer) - 1) / cost})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--what", choices=["lookup", "draft", "steps", "ceiling", "all"], default="all",
                    help="steps: the cost of a step verifying k proposals, in decode steps (Q4_1 and F16); "
                         "ceiling: prompt lookup replayed over the answers at those step costs alone")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("-k", type=int, default=5, help="num_speculative_tokens")
    ap.add_argument("--ignore-eos", action="store_true", help="always decode -n tokens, past the end of the answer")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    sys.path.insert(0, os.path.join(HERE, "..", "python"))
    import ferrum
    from ferrum.models import default_model_path
    prompts = json.load(open(os.path.join(HERE, "spec_prompts.json")))
    q4_1 = str(default_model_path())
    result = {"threads": a.t, "n": a.n, "ignore_eos": a.ignore_eos, "load_at_start": [round(x, 2) for x in os.getloadavg()]}
    if a.what in ("lookup", "all"):
        plain = ferrum.LLM(q4_1, num_threads=a.t)
        spec = ferrum.LLM(q4_1, num_threads=a.t, speculative_config={**NGRAM, "num_speculative_tokens": a.k})
        for name in ("repeated", "novel"):
            rows = side_by_side(plain, spec, prompts[name], a.n, a.r, ignore_eos=a.ignore_eos)
            if os.path.exists(PEER_VENV):
                llamacpp_lookup(q4_1, rows, a.n, a.t, a.ignore_eos)
            result[f"lookup_{name}"] = {"rows": rows, "summary": summary(f"lookup {name}", rows)}
    if a.what in ("draft", "all"):
        from moe_bench import measure_bandwidth_gbs
        f16 = f16_target(q4_1)
        plain = ferrum.LLM(f16, num_threads=a.t)
        spec = ferrum.LLM(f16, num_threads=a.t, speculative_config={"model": q4_1, "num_speculative_tokens": a.k})
        # The F16 copy has the Q4_1 file's vocabulary but no chat template: the draft's renders.
        from ferrum import _core
        from ferrum.llm import _load_tokenizer
        draft_tokenizer = _load_tokenizer(q4_1, _core.ModelFile(q4_1), None)
        rows = side_by_side(plain, spec, prompts["chat"], a.n, a.r, chat=draft_tokenizer, ignore_eos=a.ignore_eos)
        line = summary("draft model", rows)
        roof = measure_bandwidth_gbs(a.t)
        target_gb = os.path.getsize(f16) / 1e9
        line.update({"read_gbs": roof, "decode_roof_tok_s": roof / target_gb,
                     "spec_vs_roof": line["spec_tok_s"] / (roof / target_gb)})
        print(f"decode roof of the F16 target: {roof / target_gb:.1f} tok/s ({roof:.1f} GB/s over {target_gb:.3f} GB); "
              f"speculative: {line['spec_tok_s'] / (roof / target_gb):.2f}x the roof")
        result["draft"] = {"rows": rows, "summary": line}
    if a.what == "steps":
        for name, model in (("Q4_1", q4_1), ("F16", f16_target(q4_1))):
            costs = verify_step_costs(model, a.t)
            result[f"steps_{name}"] = costs
            print(f"{name}: rows in the step " + ", ".join(f"{r}: {c['ms']:.2f} ms = {c['decode_steps']:.2f}"
                                                        for r, c in costs.items()) + " decode steps")
    if a.what == "ceiling":
        costs = verify_step_costs(q4_1, a.t, rows=tuple(range(1, a.k + 2)))
        llm = ferrum.LLM(q4_1, num_threads=a.t)
        result["step_costs"] = costs
        print("Q4_1 step of 1.." + str(a.k + 1) + " rows: " + ", ".join(f"{c['decode_steps']:.2f}" for c in costs.values())
              + " decode steps")
        for name in ("repeated", "novel"):
            rows = lookup_ceiling(llm, llm.tokenizer, prompts[name], a.n, costs, a.k)
            geo = statistics.geometric_mean(r["speedup"] for r in rows)
            result[f"ceiling_{name}"] = {"rows": rows, "speedup_geomean": geo}
            print(f"lookup {name}: at most {geo:.2f}x (per prompt " + ", ".join(f"{r['speedup']:.2f}x" for r in rows)
                  + "; tokens per step " + ", ".join(f"{r['tokens_per_step']:.2f}" for r in rows) + ")")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


def f16_target(q4_1):
    """SmolLM2-135M-Instruct requantized to F16 (made once, next to the Q4_1 file)."""
    out = os.path.join(os.path.dirname(q4_1), "SmolLM2-135M-Instruct.F16.gguf")
    if not os.path.exists(out):
        from ferrum.tools.gguf_weights import read_gguf_model
        from ferrum.tools.make_model import from_dequantized
        cfg, weights = read_gguf_model(q4_1)
        tok = os.path.join(HERE, "..", "..", "shared", "models", "tokenizers", "smollm2-135m-instruct")
        from_dequantized(weights, cfg, format="gguf", dtype="f16", out=out, tokenizer=tok)
    return out


if __name__ == "__main__":
    main()
