"""What tests/test_tensor_parallel.py runs in tensor-parallel processes (under mpirun, or spawning
its ranks), and the single-process references it compares them with.

    python tp_ranks.py compare SPEC.json OUT.npz   every model's results (model_results), the
                                                   engine invariants on stories260K, and LoRA
                                                   adapters (lora_results)
    python tp_ranks.py spawn SPEC.json OUT.json    a refused split, then greedy tokens and each
                                                   rank's memory, ranks spawned by LLM()
    python tp_ranks.py generate SPEC.json          generates until a rank is killed: prints the
                                                   ranks' pids, then how the failure ended it
SPEC: {"ranks": N, "models": [{"name", "path", "tokenizer"}], ...} (see the test).
"""
import dataclasses
import glob
import json
import sys
import time

import numpy as np

import ferrum

GREEDY = ferrum.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def make_llm(model, ranks, pp=1, **kw):
    """ranks: tensor-parallel ranks per pipeline stage, of pp stages."""
    kw.setdefault("kv_dtype", "f32")
    kw.setdefault("max_model_len", 256)
    return ferrum.LLM(model["path"], device=model.get("device", "cpu"), tokenizer=model.get("tokenizer"),
                      num_threads=1, tensor_parallel_size=ranks, pipeline_parallel_size=pp, **kw)


def generation_logits(runner, prompts):
    """Logits rows as generations compute them (the decode path): each prompt's last row, then
    three decode steps of all the sequences together, each fed its argmax."""
    seqs = [runner.add_sequence() for _ in prompts]
    rows = [runner.step([(s, p, "last")]) for s, p in zip(seqs, prompts)]
    last = np.concatenate(rows)
    for _ in range(3):
        last = runner.step([(s, [int(row.argmax())], "last") for s, row in zip(seqs, last)])
        rows.append(last)
    for s in seqs:
        runner.release_sequence(s)
    return np.concatenate(rows)


def model_results(llm, prompts):
    """What a model gives under tensor parallelism and in one process alike: every position's
    logits of each prompt scored, logits of generation steps, greedy tokens of the prompts
    generated together."""
    out = {f"score{i}": llm.score(p) for i, p in enumerate(prompts)}
    out["generation"] = generation_logits(llm.runner, prompts)
    out["greedy"] = np.array([o.outputs[0].token_ids for o in
                              llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)])
    return out


def embeds_results(model, ranks, pp, prompts):
    """Prompts given as the embedding's own rows: scored (as the ids, bit for bit), generated in a
    batch mixed with id prompts, and every position's final hidden state (pooling="all")."""
    llm = make_llm(model, ranks, pp, enable_prompt_embeds=True)
    table = embedding_table(model["path"])
    rows = [{"prompt_embeds": table[p]} for p in prompts]
    out = {"embeds_scores_equal": np.array([np.array_equal(a, llm.score(p)) for a, p in
                                            zip(llm.score(rows), prompts)])}
    mixed = [rows[i] if i % 2 == 0 else {"prompt_token_ids": p} for i, p in enumerate(prompts)]
    out["embeds_greedy_mixed"] = np.array([o.outputs[0].token_ids for o in llm.generate(mixed, GREEDY)])
    out["embeds_greedy_ids"] = np.array(greedy(llm, prompts))
    for i, e in enumerate(llm.embed([{"prompt_token_ids": p} for p in prompts[:2]], pooling="all", normalize=False)):
        out[f"hidden{i}"] = np.array(e.outputs.embedding, dtype=np.float32)
    return out


def greedy(llm, prompts, lora_request=None):
    return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY,
                                                         lora_request=lora_request)]


# The requests of lora_results: two adapters, the base, and the first at other request scales.
LORA_REQUESTS = ("a", "b", "base", "a_half", "a_negative")
LORA_MIXED = ("a", "base", "b")  # the adapters of a batch's prompts, in turn


def lora_results(model, ranks, pp, prompts):
    """LoRA adapters (model["loras"]: two PEFT directories) under `pp` stages of `ranks` ranks, and
    in one process alike: every position's logits of each prompt scored and greedy tokens under
    each of LORA_REQUESTS; the prompts scored and generated in one batch of LORA_MIXED; each rank's
    adapters held ([count, bytes]), after both are removed, and after the first is used again."""
    llm = make_llm(model, ranks, pp, enable_lora=True, max_loras=2, max_lora_rank=8, enable_prefix_caching=False)
    a, b = (ferrum.LoRARequest(f"adapter{i}", i + 1, path) for i, path in enumerate(model["loras"]))
    reqs = dict(zip(LORA_REQUESTS, (a, b, None, dataclasses.replace(a, scale=0.5),
                                    dataclasses.replace(a, scale=-1.0))))
    out = {}
    for name, req in reqs.items():
        for i, p in enumerate(prompts):
            out[f"score_{name}{i}"] = llm.score(p, lora_request=req)
        out[f"greedy_{name}"] = np.array(greedy(llm, prompts, req))
    mixed = [reqs[LORA_MIXED[i % len(LORA_MIXED)]] for i in range(len(prompts))]
    for i, s in enumerate(llm.score(prompts, lora_request=mixed)):
        out[f"mixed_score{i}"] = s
    out["mixed_greedy"] = np.array(greedy(llm, prompts, mixed))
    out["held"] = held_loras(llm)
    for r in (a, b):
        assert llm.remove_lora(r.lora_int_id)
    out["held_removed"] = held_loras(llm)
    out["score_a_again"] = llm.score(prompts[0], lora_request=a)
    out["held_again"] = held_loras(llm)
    return out


def held_loras(llm):
    return np.array([[m["loras"], m["lora_bytes"]] for m in llm.runner.rank_memory()])


def engine_invariants(model, ranks, prompts, shared, pp=1):
    """Greedy tokens under tensor (and pipeline) parallelism: each prompt alone, all together,
    with chunked prefills, and prompts sharing prefixes with the prefix cache missing and hitting;
    with pipeline stages also preempted and recomputed, and verifying prompt-lookup proposals."""
    llm = make_llm(model, ranks, pp, enable_prefix_caching=False)
    out = {"alone": np.array([greedy(llm, [p])[0] for p in prompts]),
           "batch": np.array(greedy(llm, prompts))}
    out["max_forwards_in_flight"] = np.array(llm.stats()["max_forwards_in_flight"])
    del llm
    if pp > 1:
        # 7 blocks of 16 tokens cannot hold every sequence at once: preemption is forced
        llm = make_llm(model, ranks, pp, enable_prefix_caching=False, kv_cache_tokens=112)
        out["preempted"] = np.array(greedy(llm, prompts))
        out["preemptions"] = np.array(llm.stats()["preemptions"])
        del llm
        spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
        llm = make_llm(model, ranks, pp, enable_prefix_caching=False, speculative_config=spec)
        out["speculative"] = np.array(greedy(llm, prompts))
        out["spec_proposed"] = np.array(llm.stats()["spec_proposed_tokens"])
        del llm
    out["chunked"] = np.array(greedy(make_llm(model, ranks, pp, enable_prefix_caching=False,
                                              max_num_batched_tokens=7), prompts))
    out["prefix_miss"] = np.array(greedy(make_llm(model, ranks, pp, enable_prefix_caching=False), shared))
    llm = make_llm(model, ranks, pp)
    out["prefix_first"] = np.array(greedy(llm, shared))
    out["prefix_hit"] = np.array(greedy(llm, shared))
    st = llm.stats()
    out["prefix_hit_tokens"] = np.array(st["prefix_hit_tokens"])
    out["blocks_used_after"] = np.array(st["kv_blocks_used"])
    return out


def compare(spec, out_path):
    ranks, prompts = spec["ranks"], spec["prompts"]
    results = {}
    for model in spec["refused"]:  # a split that cannot be made: every rank goes on to the next model
        try:
            make_llm(model, ranks)
            results[f"{model['name']}/refused"] = np.array("")
        except ValueError as e:
            results[f"{model['name']}/refused"] = np.array(str(e))
    for model in spec["models"]:
        llm = make_llm(model, ranks)
        for k, v in model_results(llm, prompts).items():
            results[f"{model['name']}/{k}"] = v
        st = llm.stats()
        results[f"{model['name']}/all_reduces"] = np.array(st["all_reduces"])
        del llm
    inv = engine_invariants(spec["invariants_model"], ranks, spec["invariant_prompts"], spec["shared_prompts"])
    results.update({f"invariants/{k}": v for k, v in inv.items()})
    results.update({f"lora/{k}": v for k, v in lora_results(spec["lora_model"], ranks, 1, prompts).items()})
    np.savez(out_path, **results)


def spawn(spec, out_path):
    ranks, model = spec["ranks"], spec["model"]
    out = {}
    try:
        make_llm(spec["refused"], ranks)
    except ValueError as e:
        out["refused"] = str(e)
    llm = make_llm(model, ranks)
    out["greedy"] = greedy(llm, spec["prompts"])
    out["memory"] = llm.runner.rank_memory()
    out["weight_bytes"] = llm.stats()["weight_bytes"]
    del llm
    big = make_llm(spec["big_model"], ranks, enable_prompt_embeds=True)
    out["big_memory"] = big.runner.rank_memory()
    # prompts given as the embedding's own rows: every rank reads them from rank 0's plan
    table = embedding_table(spec["big_model"]["path"])
    ids = spec["prompts"][:2]
    by_ids = [big.score(p) for p in ids]
    mixed = big.score([{"prompt_embeds": table[ids[0]]}, ids[1], {"prompt_embeds": table[ids[1]]}])
    out["embeds_score_equal"] = [bool(np.array_equal(a, b)) for a, b in zip(mixed, by_ids + by_ids[1:])]
    with open(out_path, "w") as f:
        json.dump(out, f)


def embedding_table(hf_dir):
    from safetensors.numpy import load_file
    weights = {}
    for f in sorted(glob.glob(f"{hf_dir}/*.safetensors")):
        weights.update(load_file(f))
    return weights["model.embed_tokens.weight"]


def generate(spec):
    """Generates while the test kills (or stops) a rank; prints how the generation ended."""
    llm = make_llm(spec["model"], spec["ranks"], spec.get("pp", 1), max_model_len=512)
    print(json.dumps({"pids": [m["pid"] for m in llm.runner.rank_memory()]}), flush=True)
    params = ferrum.SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    prompt = [1] + list(range(3, 40))
    while True:
        try:
            llm.generate(prompt_token_ids=[prompt] * 4, sampling_params=params)
            print("generated", flush=True)
        except RuntimeError as e:
            print(json.dumps({"error": str(e), "at": time.time()}), flush=True)
            try:  # the group is ended: later calls fail at once
                llm.generate(prompt_token_ids=[prompt], sampling_params=params)
            except RuntimeError as again:
                print(json.dumps({"again": str(again)}), flush=True)
            return 3


def main(argv):
    command, spec_path = argv[1], argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    if command == "compare":
        compare(spec, argv[3])
    elif command == "spawn":
        spawn(spec, argv[3])
    elif command == "generate":
        return generate(spec)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
