"""The `ferrum` command (also `python -m ferrum`): generate, chat, bench, serve."""
from __future__ import annotations

import argparse
import json
import signal
import sys


def _add_model_args(p):
    p.add_argument("--model", "-m", default=None,
                   help="model directory, .gguf / llama2.c .bin file, or hub id (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--device", default="cpu", help="cpu or opencl[:platform[:device]] (default: cpu)")
    p.add_argument("--threads", "-t", type=int, default=None, help="CPU threads (default: all cores)")


def _add_engine_args(p):
    p.add_argument("--kv-dtype", default="f16", choices=["f16", "f32", "int8"], help="KV cache dtype")
    p.add_argument("--max-model-len", type=int, default=None, help="context length limit")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, as vLLM configures it: \'{"method": "ngram", '
                        '"num_speculative_tokens": 5}\' or \'{"model": DRAFT, "num_speculative_tokens": 5}\'')
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the model between this many ranks over MPI (docs/distributed.md)")
    p.add_argument("--pipeline-parallel-size", type=int, default=1,
                   help="split the model's layers between this many stages over MPI, each of "
                        "--tensor-parallel-size ranks (docs/distributed.md)")


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
               max_model_len=args.max_model_len, speculative_config=args.speculative_config,
               tensor_parallel_size=args.tensor_parallel_size,
               pipeline_parallel_size=args.pipeline_parallel_size)


def cmd_generate(args) -> int:
    prompt = args.prompt
    if prompt is None:
        if sys.stdin.isatty():
            raise ValueError("give a PROMPT, or pipe one in (echo hi | ferrum generate)")
        prompt = sys.stdin.read()
        prompt = prompt[:-1] if prompt.endswith("\n") else prompt  # the newline echo and files end with
        if not prompt:
            raise ValueError("the prompt read from standard input is empty")
    llm = _llm(args)
    for piece in llm.stream(prompt, _params(args)):
        print(piece, end="", flush=True)
    print()
    return 0


CHAT_HELP = ("/reset starts over, /system TEXT sets the system prompt, /save FILE writes the conversation "
             "as JSON; Ctrl-C stops a reply, Ctrl-C twice or Ctrl-D quits")


class Chat:
    """A conversation with the model: its messages (the system prompt first, when there is one)
    and each reply streamed to stdout as it is generated."""

    def __init__(self, llm, params, system=None):
        self.llm, self.params = llm, params
        self.messages = [{"role": "system", "content": system}] if system else []

    def reply(self, text: str) -> None:
        """Answers `text`, printing the reply as it comes; Ctrl-C (SIGINT) stops the reply there,
        and what was said so far stays in the conversation. The signal only raises a flag that is
        read between deltas: an interrupt never lands inside an engine step."""
        self.messages.append({"role": "user", "content": text})
        prompt = self.llm.tokenizer.apply_chat_template(self.messages, add_generation_prompt=True)
        interrupted = []
        previous = signal.signal(signal.SIGINT, lambda *_: interrupted.append(True))
        pieces = self.llm.stream(self.llm.tokenizer.encode(prompt), self.params)
        reply = ""
        try:
            for piece in pieces:
                reply += piece
                print(piece, end="", flush=True)
                if interrupted:
                    break
        finally:
            pieces.close()  # aborts the request when it stopped early
            signal.signal(signal.SIGINT, previous)
        print(" [stopped]" if interrupted else "", flush=True)
        self.messages.append({"role": "assistant", "content": reply})

    def command(self, line: str) -> None:
        """/reset, /system TEXT, /save FILE."""
        name, _, rest = line.partition(" ")
        rest = rest.strip()
        if name == "/reset":
            self.messages = [m for m in self.messages if m["role"] == "system"]
            print("(conversation reset)", file=sys.stderr)
        elif name == "/system" and rest:
            self.messages = [{"role": "system", "content": rest}] + [
                m for m in self.messages if m["role"] != "system"]
            print("(system prompt set)", file=sys.stderr)
        elif name == "/save" and rest:
            with open(rest, "w") as f:
                json.dump(self.messages, f, indent=2, ensure_ascii=False)
                f.write("\n")
            print(f"(saved {len(self.messages)} messages to {rest})", file=sys.stderr)
        else:
            print(f"unknown command {line!r}: {CHAT_HELP}", file=sys.stderr)


def cmd_chat(args) -> int:
    chat = Chat(_llm(args), _params(args), args.system)
    if args.message:  # one turn: only the reply is printed
        chat.reply(args.message)
        return 0
    interactive = sys.stdin.isatty()
    if interactive:
        _enable_line_editing()
        print(f"ferrum chat: type a message; {CHAT_HELP}", file=sys.stderr)
    interrupted_at_prompt = False
    while True:
        try:
            text = input("> ")
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            if interrupted_at_prompt:
                print()
                return 0
            interrupted_at_prompt = True
            print("\n(Ctrl-C again or Ctrl-D to quit)", file=sys.stderr)
            continue
        interrupted_at_prompt = False
        text = text.strip()
        if text.startswith("/"):
            try:
                chat.command(text)
            except OSError as e:
                print(f"ferrum: {e}", file=sys.stderr)
        elif text:
            chat.reply(text)


def _enable_line_editing() -> None:
    """readline: line editing, and the history of earlier sessions (in ferrum's cache directory)."""
    try:
        import readline
    except ImportError:  # Python built without it: plain input() still works
        return
    import atexit
    from .models import cache_dir
    path = cache_dir() / "chat_history"
    try:
        readline.read_history_file(path)
    except OSError:
        pass
    readline.set_history_length(1000)

    def save():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            readline.write_history_file(path)
        except OSError:
            pass
    atexit.register(save)


def cmd_serve(args) -> int:
    from .server.main import run
    return run(args)


def cmd_bench(args) -> int:
    from .bench import run_bench
    run_bench(args)
    return 0


def main(argv=None) -> int:
    from . import __version__
    ap = argparse.ArgumentParser(prog="ferrum", description="ferrum: LLM inference from Python and the shell")
    ap.add_argument("--version", action="version", version=f"ferrum {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="continue a prompt and print the text as it is generated",
                       description="Continue PROMPT (or what standard input holds, less its final newline) "
                                   "and print the text as it is generated (greedy by default).")
    g.add_argument("prompt", nargs="?", default=None, help="the text to continue (default: read standard input)")
    _add_model_args(g)
    _add_engine_args(g)
    _add_sampling_args(g, temperature=0.0)
    g.set_defaults(fn=cmd_generate)

    c = sub.add_parser("chat", help="chat through the model's chat template (interactive, keeps history)",
                       description="Chat through the model's chat template. Interactive by default, with line "
                                   f"editing; the conversation history is kept: {CHAT_HELP}. With MESSAGE, "
                                   "print only the reply to it and exit.")
    c.add_argument("message", nargs="?", default=None, help="answer this one message and exit")
    c.add_argument("--system", default=None, help="system prompt")
    _add_model_args(c)
    _add_engine_args(c)
    _add_sampling_args(c, temperature=0.7)
    c.set_defaults(fn=cmd_chat)

    b = sub.add_parser("bench", help="llama-bench-style pp / tg tokens/s and peak RSS",
                       description="Prompt processing (pp) and generation (tg) tokens/s (the best of R runs, "
                                   "and their mean +- sd), peak RSS and the tokenizer's cost per token.")
    b.add_argument("model_path", nargs="?", default=None, metavar="MODEL", help="the model (or -m MODEL)")
    _add_model_args(b)
    b.add_argument("-p", "--n-prompt", type=int, default=128, help="prompt tokens (default: 128)")
    b.add_argument("-n", "--n-gen", type=int, default=128, help="generated tokens (default: 128)")
    b.add_argument("--repetitions", "-r", type=int, default=3, help="runs (default: 3)")
    b.add_argument("--json", action="store_true", help="print one JSON line")
    b.set_defaults(fn=cmd_bench)

    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs ferrum[serve])",
                       description="Serve MODEL over the OpenAI API (/v1/completions, /v1/chat/completions, "
                                   "/v1/models, /health, /metrics, /tokenize, /detokenize) until Ctrl-C or SIGTERM.")
    from .server.main import add_arguments as add_serve_arguments  # argparse only: no server imports
    add_serve_arguments(s)
    s.set_defaults(fn=cmd_serve)

    args = ap.parse_args(argv)
    if args.command == "bench":
        if args.model_path is not None and args.model is not None:
            ap.error("give the model once: as MODEL or with -m")
        args.model_path = args.model_path or args.model
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        return 130
    except (ValueError, TypeError, FileNotFoundError, RuntimeError, MemoryError) as e:
        print(f"ferrum: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
