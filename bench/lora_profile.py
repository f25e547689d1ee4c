"""One request on a LoRA adapter (or on the base), repeated, for FERRUM_PROFILE=1: what the
adapter's shrink and expand cost a prompt (-n 1) or a decode (-p 1 -n 256) against the base's matmuls;
--requests N runs N such requests together, on the one adapter (a batched decode).

usage: FERRUM_PROFILE=1 python bench/lora_profile.py [--base] [-p 128] [-n 1] [-r 4] [-t 2]
                                                    [--requests 1] [--data-dir ~/.cache/ferrum-bench]
The base model, the adapter and the prompt are bench/lora_bench.py's (its files are written into
--data-dir when missing).
"""
import argparse
import os
import sys

import ferrum
from ferrum import LoRARequest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lora_bench import RANK, make_files, stream_prompt  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", action="store_true", help="no adapter")
    ap.add_argument("-p", type=int, default=128, help="prompt tokens")
    ap.add_argument("-n", type=int, default=1, help="generated tokens")
    ap.add_argument("-r", type=int, default=4, help="requests, one after another")
    ap.add_argument("-t", type=int, default=2, help="threads")
    ap.add_argument("--requests", type=int, default=1, help="requests run together")
    ap.add_argument("--data-dir", default="~/.cache/ferrum-bench")
    a = ap.parse_args()
    base, adapters, _ = make_files(a.data_dir, 1)
    llm = ferrum.LLM(base, num_threads=a.t, enable_lora=True, max_loras=1, max_lora_rank=RANK,
                     enable_prefix_caching=False, max_num_seqs=a.requests,
                     kv_cache_tokens=a.requests * (a.p + a.n + 64))
    lora = None if a.base else LoRARequest("a", 1, adapters[0])
    prompt = stream_prompt(llm.config["vocab_size"], a.p)
    params = ferrum.SamplingParams(max_tokens=a.n, temperature=0, ignore_eos=True)
    for _ in range(a.r):
        llm.generate(prompt_token_ids=[prompt] * a.requests, sampling_params=params, lora_request=lora)


if __name__ == "__main__":
    main()
