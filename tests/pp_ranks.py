"""What tests/test_pipeline_parallel.py runs in pipeline-parallel processes under mpirun; the
single-process references it compares them with, and the generation a killed rank ends, are
tp_ranks.py's.

    python pp_ranks.py compare SPEC.json OUT.npz   refused partitions, every model's results
                                                   (tp_ranks.model_results) with its ranks' stages
                                                   and memory, the engine invariants, and LoRA
                                                   adapters (tp_ranks.lora_results)
SPEC: {"tp": T, "pp": P, "models": [{"name", "path", "tokenizer", "partition"}], ...} (see the test).
"""
import json
import sys

import numpy as np

import tp_ranks

MEMORY_FIELDS = ("stage", "layer0", "layers", "weight_bytes", "kv_bytes")


def compare(spec, out_path):
    tp, pp, prompts = spec["tp"], spec["pp"], spec["prompts"]
    results = {}
    for i, (model, partition) in enumerate(spec["refused"]):  # every rank goes on to the next model
        try:
            tp_ranks.make_llm(model, tp, pp, pipeline_layer_partition=partition)
            results[f"refused{i}"] = np.array("")
        except ValueError as e:
            results[f"refused{i}"] = np.array(str(e))
    for model in spec["models"]:
        llm = tp_ranks.make_llm(model, tp, pp, pipeline_layer_partition=model.get("partition"))
        if not model.get("memory_only"):
            for k, v in tp_ranks.model_results(llm, prompts).items():
                results[f"{model['name']}/{k}"] = v
        if model.get("embeds"):
            for k, v in tp_ranks.embeds_results(model, tp, pp, prompts[:3]).items():
                results[f"{model['name']}/{k}"] = v
        st = llm.stats()
        for k in ("hand_offs", "hand_off_bytes", "all_reduces", "pipeline_parallel_size", "tensor_parallel_size"):
            results[f"{model['name']}/{k}"] = np.array(st[k])
        results[f"{model['name']}/memory"] = np.array([[m[k] for k in MEMORY_FIELDS]
                                                       for m in llm.runner.rank_memory()])
        del llm
    if "invariants_model" in spec:
        inv = tp_ranks.engine_invariants(spec["invariants_model"], tp, spec["invariant_prompts"],
                                         spec["shared_prompts"], pp)
        results.update({f"invariants/{k}": v for k, v in inv.items()})
    results.update({f"lora/{k}": v for k, v in tp_ranks.lora_results(spec["lora_model"], tp, pp, prompts).items()})
    np.savez(out_path, **results)


def main(argv):
    with open(argv[2]) as f:
        spec = json.load(f)
    if argv[1] == "compare":
        compare(spec, argv[3])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
