"""llama.cpp's prompt-lookup decoding, for bench/spec_bench.py (runs in the peer's own venv).

usage: PEER_PYTHON llamacpp_lookup.py MODEL.gguf PROMPTS.json N THREADS [--ignore-eos]
PROMPTS.json holds a list of token-id lists. Prints one JSON line: per prompt, greedy decode
tokens/s (first generated token to the last) of up to N tokens, ending at an end-of-generation
token unless --ignore-eos, without and with LlamaPromptLookupDecoding.
"""
import json
import sys
import time

import llama_cpp
from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding


def decode_rate(llm, prompt, n, ignore_eos):
    count, first = 0, None
    for token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        count += 1
        if first is None:
            first = time.perf_counter()
        if count >= n or (not ignore_eos and llama_cpp.llama_vocab_is_eog(llm._model.vocab, token)):
            break
    return (count - 1) / (time.perf_counter() - first)


def main():
    path, prompts, n, threads = sys.argv[1], json.load(open(sys.argv[2])), int(sys.argv[3]), int(sys.argv[4])
    ignore_eos = "--ignore-eos" in sys.argv[5:]
    kw = dict(model_path=path, n_ctx=2048, n_batch=512, n_threads=threads, n_threads_batch=threads, verbose=False)
    plain = Llama(**kw)
    lookup = Llama(**kw, draft_model=LlamaPromptLookupDecoding(max_ngram_size=4, num_pred_tokens=5))
    print(json.dumps([{"plain": decode_rate(plain, p, n, ignore_eos), "lookup": decode_rate(lookup, p, n, ignore_eos)}
                      for p in prompts]))


if __name__ == "__main__":
    main()
