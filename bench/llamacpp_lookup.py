"""llama.cpp's prompt-lookup decoding, for bench/spec_bench.py (runs in the peer's own venv).

usage: PEER_PYTHON llamacpp_lookup.py MODEL.gguf PROMPTS.json N THREADS
PROMPTS.json holds a list of token-id lists. Prints one JSON line: per prompt, greedy decode
tokens/s (first generated token to the last) without and with LlamaPromptLookupDecoding.
"""
import json
import sys
import time

from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding


def decode_rate(llm, prompt, n):
    count, first = 0, None
    for _ in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        count += 1
        if first is None:
            first = time.perf_counter()
        if count >= n:
            break
    return (count - 1) / (time.perf_counter() - first)


def main():
    path, prompts, n, threads = sys.argv[1], json.load(open(sys.argv[2])), int(sys.argv[3]), int(sys.argv[4])
    kw = dict(model_path=path, n_ctx=2048, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False)
    plain = Llama(**kw)
    lookup = Llama(**kw, draft_model=LlamaPromptLookupDecoding(max_ngram_size=4, num_pred_tokens=5))
    print(json.dumps([{"plain": decode_rate(plain, p, n), "lookup": decode_rate(lookup, p, n)} for p in prompts]))


if __name__ == "__main__":
    main()
