"""One request on a LoRA adapter (or on the base), repeated, for FERRUM_PROFILE=1: what the
adapter's shrink and expand cost a prompt (-n 1) or a decode (-p 1 -n 256) against the base's matmuls.

usage: FERRUM_PROFILE=1 python bench/lora_profile.py [--base] [-p 128] [-n 1] [-r 4] [-t 2]
                                                    [--data-dir ~/.cache/ferrum-bench]
The base model and the adapter are the ones bench/lora_bench.py writes into --data-dir (run it
once first).
"""
import argparse
import os

import ferrum
from ferrum import LoRARequest


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", action="store_true", help="no adapter")
    ap.add_argument("-p", type=int, default=128, help="prompt tokens")
    ap.add_argument("-n", type=int, default=1, help="generated tokens")
    ap.add_argument("-r", type=int, default=4, help="requests, one after another")
    ap.add_argument("-t", type=int, default=2, help="threads")
    ap.add_argument("--data-dir", default="~/.cache/ferrum-bench")
    a = ap.parse_args()
    d = os.path.expanduser(a.data_dir)
    llm = ferrum.LLM(os.path.join(d, "tinyllama-1.1b-q4_k_m.gguf"), num_threads=a.t, enable_lora=True, max_loras=1,
                     max_lora_rank=16, enable_prefix_caching=False, kv_cache_tokens=a.p + a.n + 64)
    lora = None if a.base else LoRARequest("a", 1, os.path.join(d, "tinyllama-lora-r16-f16-0"))
    vocab = llm.config["vocab_size"]
    prompt = [1] + [100 + (13 * i) % (vocab - 200) for i in range(a.p - 1)]
    params = ferrum.SamplingParams(max_tokens=a.n, temperature=0, ignore_eos=True)
    for _ in range(a.r):
        llm.generate(prompt_token_ids=[prompt], sampling_params=params, lora_request=lora)


if __name__ == "__main__":
    main()
