"""llama.cpp with a LoRA adapter, one stream, for bench/lora_bench.py (run with llama-cpp-python's
own interpreter).

usage: python llamacpp_lora.py MODEL.gguf N_PROMPT N_GEN THREADS [ADAPTER.gguf]
Prints one JSON line: pp_tok_s (a N_PROMPT-token prompt, best of 3) and tg_tok_s (greedy, the
tokens after the first), as ../shared/bench/llamacpp/bench.py measures them.
"""
import json
import sys
import time

from llama_cpp import Llama


def main():
    model, n_prompt, n_gen, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    lora = sys.argv[5] if len(sys.argv) > 5 else None
    llm = Llama(model_path=model, lora_path=lora, n_ctx=max(1024, n_prompt + n_gen + 16), n_batch=512,
                n_threads=threads, n_threads_batch=threads, verbose=False)
    vocab = llm.n_vocab()
    prompt = [1] + [100 + (13 * i) % (vocab - 200) for i in range(n_prompt - 1)]
    pp = float("inf")
    for _ in range(3):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        pp = min(pp, time.perf_counter() - t0)
    gen = []
    for tok in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        gen.append(int(tok))
        if len(gen) == 1:
            t1 = time.perf_counter()
        if len(gen) > n_gen:
            break
    t2 = time.perf_counter()
    print(json.dumps({"lora": lora, "pp_tok_s": n_prompt / pp, "tg_tok_s": (len(gen) - 1) / (t2 - t1)}))


if __name__ == "__main__":
    main()
