"""The `ferrum` command (also `python -m ferrum`): generate, chat, bench."""
from __future__ import annotations

import argparse
import sys
import time


def _add_model_args(p):
    p.add_argument("--model", "-m", default=None,
                   help="model directory, .gguf / llama2.c .bin file, or hub id (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--device", default="cpu", help="cpu or opencl[:platform[:device]] (default: cpu)")
    p.add_argument("--threads", "-t", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--kv-dtype", default="f16", choices=["f16", "f32", "int8"], help="KV cache dtype")
    p.add_argument("--max-model-len", type=int, default=None, help="context length limit")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the model between this many ranks over MPI (docs/distributed.md)")


def _add_sampling_args(p, temperature):
    p.add_argument("--max-tokens", "-n", type=int, default=256, help="tokens to generate (default: 256)")
    p.add_argument("--temperature", type=float, default=temperature, help=f"0 = greedy (default: {temperature})")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0)")
    p.add_argument("--min-p", type=float, default=0.0, help="min-p filtering (default: 0)")
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None, help="random seed for reproducible sampling")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")


def _params(args):
    from .sampling import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          seed=args.seed, stop=args.stop)


def _llm(args):
    from .llm import LLM
    return LLM(args.model, device=args.device, kv_dtype=args.kv_dtype, num_threads=args.threads,
               max_model_len=args.max_model_len, tensor_parallel_size=args.tensor_parallel_size)


def cmd_generate(args) -> int:
    llm = _llm(args)
    for piece in llm.stream(args.prompt, _params(args)):
        print(piece, end="", flush=True)
    print()
    return 0


def cmd_chat(args) -> int:
    llm = _llm(args)
    params = _params(args)
    history = []
    if args.system:
        history.append({"role": "system", "content": args.system})

    def answer(text):
        history.append({"role": "user", "content": text})
        prompt = llm.tokenizer.apply_chat_template(history, add_generation_prompt=True)
        reply = ""
        for piece in llm.stream(llm.tokenizer.encode(prompt), params):
            reply += piece
            print(piece, end="", flush=True)
        print()
        history.append({"role": "assistant", "content": reply})

    if args.message:  # one turn, then exit
        print(f"> {args.message}")
        answer(args.message)
        return 0
    print("ferrum chat: type a message, /clear to start over, Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            text = input("> ")
        except EOFError:
            print()
            return 0
        if text.strip() == "/clear":
            del history[int(bool(args.system)):]
            continue
        if text.strip():
            answer(text)


def cmd_bench(args) -> int:
    from .bench import run_bench
    run_bench(args)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="ferrum", description="ferrum: LLM inference from Python and the shell")
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="continue a prompt and print the text as it is generated",
                       description="Continue PROMPT and print the text as it is generated (greedy by default).")
    g.add_argument("prompt", help="the text to continue")
    _add_model_args(g)
    _add_sampling_args(g, temperature=0.0)
    g.set_defaults(fn=cmd_generate)

    c = sub.add_parser("chat", help="chat through the model's chat template (interactive, keeps history)",
                       description="Chat through the model's chat template. Interactive by default: the "
                                   "conversation history is kept, /clear starts over, Ctrl-D quits. With "
                                   "MESSAGE, answer it once and exit.")
    c.add_argument("message", nargs="?", default=None, help="answer this one message and exit")
    c.add_argument("--system", default=None, help="system prompt")
    _add_model_args(c)
    _add_sampling_args(c, temperature=0.7)
    c.set_defaults(fn=cmd_chat)

    b = sub.add_parser("bench", help="llama-bench-style pp / tg tokens/s and peak RSS",
                       description="Prompt processing (pp) and generation (tg) tokens/s, peak RSS and "
                                   "the tokenizer's cost per token, best of R runs.")
    b.add_argument("model_path", nargs="?", default=None, help="model (default: the default model)")
    b.add_argument("-p", "--n-prompt", type=int, default=128, help="prompt tokens (default: 128)")
    b.add_argument("-n", "--n-gen", type=int, default=128, help="generated tokens (default: 128)")
    b.add_argument("-t", "--threads", type=int, default=2, help="threads (default: 2)")
    b.add_argument("--device", default="cpu")
    b.add_argument("--repetitions", "-r", type=int, default=3, help="best of r (default: 3)")
    b.add_argument("--json", action="store_true", help="print one JSON line")
    b.set_defaults(fn=cmd_bench)

    args = ap.parse_args(argv)
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError, RuntimeError, MemoryError) as e:
        print(f"ferrum: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
