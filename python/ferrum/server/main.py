"""``ferrum serve``: its arguments, and running the server until SIGINT / SIGTERM."""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import threading
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="model directory, .gguf / llama2.c .bin file, or hub id (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0 picks a free one)")
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on every route but /health and /metrics")
    p.add_argument("--allowed-origins", nargs="*", default=[], metavar="ORIGIN",
                   help="browser origins allowed by CORS, e.g. http://localhost:3000, or '*' (default: none)")
    p.add_argument("--served-model-name", default=None,
                   help="the model's name in the API (default: the model file or directory name)")
    p.add_argument("--device", default="cpu", help="cpu or opencl[:platform[:device]] (default: cpu)")
    p.add_argument("--threads", "-t", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--kv-dtype", default="f16", choices=["f16", "f32", "int8"], help="KV cache dtype")
    p.add_argument("--max-model-len", type=int, default=None, help="context length limit")
    p.add_argument("--kv-cache-tokens", type=int, default=None, help="size the KV cache in tokens")
    p.add_argument("--max-num-seqs", type=int, default=32, help="sequences in the running batch (default: 32)")
    p.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="tokens in one forward (default: 512)")
    p.add_argument("--no-prefix-caching", action="store_true", help="do not reuse earlier prompts' KV blocks")
    p.add_argument("--speculative-config", default=None,
                   help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 5}\'')
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories or llama.cpp .gguf files) served beside the model, a request's `model` choosing one: "
                        "name=path, or vLLM's JSON {\"name\": ..., \"path\": ...}; implies --enable-lora")
    p.add_argument("--enable-lora", action="store_true", help="let requests run LoRA adapters")
    p.add_argument("--enable-lora-updates", action="store_true",
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's; anyone who may "
                        "call the API may then load files the server can read, so pair it with --api-key); "
                        "implies --enable-lora")
    p.add_argument("--max-loras", type=int, default=1, help="different adapters in one step (default: 1)")
    p.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank (default: 16)")
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept loaded in host memory (default: max(--max-loras, the modules given))")
    p.add_argument("--lora-dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16", "q8_0"],
                   help="what adapters' A and B are kept in (default: auto, as their files store them)")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the model between this many ranks over MPI (docs/distributed.md)")
    p.add_argument("--pipeline-parallel-size", type=int, default=1,
                   help="split the model's layers between this many stages over MPI, each of "
                        "--tensor-parallel-size ranks (docs/distributed.md)")
    p.add_argument("--max-waiting-requests", type=int, default=256,
                   help="requests waiting to run before new ones get 503 (default: 256)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds requests in flight may take to finish on SIGTERM before they are aborted (default: 10)")
    p.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json", "mistral", "pythonic"],
                   help="the format the model writes tool calls in (default: told from its chat template)")
    p.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1", "none"],
                   help="split <think> reasoning out of replies (default: when the chat template has <think>)")
    p.add_argument("--no-web-ui", action="store_true", help="do not serve the chat page at /")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def parse_lora_modules(items) -> list:
    """--lora-modules: name=path or {"name": ..., "path": ..., "base_model_name": ...}, as
    LoRARequests numbered from 1. ValueError for anything else."""
    import json
    from ..lora import LoRARequest
    out = []
    for i, item in enumerate(items, 1):
        if item.lstrip().startswith("{"):
            try:
                d = json.loads(item)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules: {item!r} is not JSON ({e})") from None
            if not isinstance(d, dict) or not {"name", "path"} <= set(d) or set(d) - {"name", "path", "base_model_name"}:
                raise ValueError(f"--lora-modules: {item!r} needs \"name\" and \"path\" (and at most "
                                 f"\"base_model_name\")")
            out.append(LoRARequest(d["name"], i, d["path"], d.get("base_model_name")))
        else:
            name, sep, path = item.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules: {item!r} is not name=path")
            out.append(LoRARequest(name, i, path))
    return out


def run(args: argparse.Namespace) -> int:
    """Loads the model, serves until SIGINT / SIGTERM, then stops: no new connections, requests
    in flight finish within --shutdown-timeout or are aborted; returns 0 after SIGTERM."""
    try:
        import uvicorn
        from .app import build_app
    except ImportError as e:
        raise RuntimeError(f"`ferrum serve` needs the serve extra: pip install 'ferrum[serve]' ({e})") from None
    from ..async_llm import AsyncLLM
    from ..llm import LLM

    loras = parse_lora_modules(args.lora_modules)
    enable_lora = args.enable_lora or args.enable_lora_updates or bool(loras)
    llm = LLM(args.model, device=args.device, kv_dtype=args.kv_dtype, num_threads=args.threads,
              max_model_len=args.max_model_len, kv_cache_tokens=args.kv_cache_tokens,
              enable_prefix_caching=not args.no_prefix_caching, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, speculative_config=args.speculative_config,
              enable_lora=enable_lora, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
              max_cpu_loras=args.max_cpu_loras or max(args.max_loras, len(loras), 1), lora_dtype=args.lora_dtype,
              tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size)
    for lora in loras:  # a bad adapter stops the server before it serves
        llm.add_lora(lora)
    name = args.served_model_name or Path(llm.model_path).name
    engine = AsyncLLM(llm)
    try:
        app = build_app(engine, name, api_key=args.api_key, max_waiting_requests=args.max_waiting_requests,
                        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser,
                        allowed_origins=args.allowed_origins,
                        shutdown_grace_seconds=args.shutdown_timeout + 5, web_ui=not args.no_web_ui,
                        lora_modules=loras, enable_lora_updates=args.enable_lora_updates)
        # Streams are cut only if aborting them has not ended them by then.
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                timeout_graceful_shutdown=args.shutdown_timeout + 10)
        # uvicorn raises the signal it stopped for again once it has shut down; a SIGTERM handled
        # here makes that a clean exit.
        previous = signal.signal(signal.SIGTERM, lambda *_: None)
        _engine_first()
        try:
            _graceful_server(uvicorn, config, engine, args.shutdown_timeout).run()
        finally:
            signal.signal(signal.SIGTERM, previous)
    finally:
        engine.shutdown()
    return 0


def _engine_first() -> None:
    """Runs the event loop's thread (this one) only on a core the engine's threads leave idle.
    With as many compute threads as cores, each wake of the loop (a streamed delta, a request)
    would otherwise take a core from a thread the forward's next barrier waits for; behind the
    engine, the loop takes the deltas that waited as one (AsyncLLM merges them)."""
    if hasattr(os, "SCHED_IDLE"):  # Linux: the policy is the calling thread's
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def _graceful_server(uvicorn, config, engine, grace_s: float):
    """A uvicorn server that, once told to stop, gives the requests in flight `grace_s` seconds,
    then shuts the engine down: what still runs ends with finish_reason "abort", and its
    response (a stream too) completes normally."""
    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not self.should_exit:
                timer = threading.Timer(grace_s, engine.shutdown)
                timer.daemon = True  # run() shuts the engine down itself if the server stops sooner
                timer.start()
            super().handle_exit(sig, frame)
    return Server(config)
