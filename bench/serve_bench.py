"""ferrum's OpenAI-compatible server vs llama.cpp's (llama-cpp-python's llama_cpp.server), side by
side: time to first token, inter-token latency and aggregate throughput at 1, 8 and 32 concurrent
streaming clients (the `openai` client), the same prompts and lengths for both; the single-client
throughput next to LLM.generate's in-process (through the openai client and through a bare SSE
reader); and what structured output's token masks cost.

usage: python bench/serve_bench.py [MODEL.gguf] [-c 1,8,32] [-r 2] [-p 128] [-n 128] [-t 2]
                                   [--pairs 8] [--no-peer] [--no-structured] [--out FILE.json]

Each client sends -r requests one after another (temperature 0; ferrum with ignore_eos, llama.cpp
with min_tokens, so every request generates exactly -n tokens). llama_cpp.server runs one request
at a time (--interrupt_requests False queues the others instead of cutting them off); it is
installed into the peer's own venv (../shared/bench/llamacpp/run.sh makes that venv) on first use.
Run it on a quiet machine: the two servers run one after the other, never together.
"""
import argparse
import asyncio
import datetime
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
PEER_DIR = os.environ.get("FERRUM_PEER_DIR", os.path.expanduser("~/.cache/ferrum-peer/llama-cpp-python"))
PEER_PY = os.path.join(PEER_DIR, "venv", "bin", "python")
PEER_VERSION = os.environ.get("LLAMA_CPP_PYTHON_VERSION", "0.3.36")
SERVED_NAME = "bench"
START_TIMEOUT_S = 300
TEXT = ("The old lighthouse keeper climbed the spiral stairs every evening, counting the steps as his "
        "father had taught him. Out on the water the fishing boats were coming home, their lanterns "
        "swinging, and the gulls followed them in wide, lazy circles. He lit the great lamp, wiped the "
        "salt from the glass and sat down with his logbook to write what the day had brought: the wind "
        "from the west, a fog bank at noon, a ship he did not know that passed far out near the reef. ")
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "city": {"type": "string", "maxLength": 20}},
          "required": ["name", "age", "city"], "additionalProperties": False}


def make_prompts(tokenizer, count, tokens):
    """`count` different prompts of exactly `tokens` tokens (for ferrum's tokenizer, which
    llama.cpp shares through the GGUF), each a different slice of a long text."""
    ids = tokenizer.encode(TEXT * (1 + (tokens + count * 7) // 60), add_special_tokens=False)
    return [tokenizer.decode(ids[7 * i:7 * i + tokens]) for i in range(count)]


# ---- servers ----

class Server:
    """A server subprocess; its output is drained in a thread (kept for errors)."""

    def __init__(self, cmd, url_pattern=None, url=None):
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.log, self.url = [], url
        found = threading.Event()

        def drain():
            for line in self.proc.stdout:
                self.log.append(line)
                m = url_pattern and re.search(url_pattern, line)
                if m and self.url is None:
                    self.url = m.group(1)
                    found.set()
        threading.Thread(target=drain, daemon=True).start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("the server exited:\n" + "".join(self.log[-40:]))
            if self.url and _answers(self.url + "/v1/models"):
                return
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("the server did not start:\n" + "".join(self.log[-40:]))

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _answers(url):
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ferrum(model, threads, n_ctx):
    return Server([sys.executable, "-m", "ferrum", "serve", model, "--port", "0", "--threads", str(threads),
                   "--max-model-len", str(n_ctx), "--served-model-name", SERVED_NAME],
                  url_pattern=r"Uvicorn running on (http://127\.0\.0\.1:\d+)")


def ensure_peer_server():
    if subprocess.run([PEER_PY, "-c", "import llama_cpp.server.app"], capture_output=True).returncode == 0:
        return
    if not os.path.exists(PEER_PY):
        raise RuntimeError(f"no llama.cpp peer venv at {PEER_DIR}: run ../shared/bench/llamacpp/run.sh once")
    print("installing llama-cpp-python[server] into the peer venv", file=sys.stderr)
    subprocess.run([PEER_PY, "-m", "pip", "install", "-q", f"llama-cpp-python[server]=={PEER_VERSION}"], check=True)


def start_llamacpp(model, threads, n_ctx):
    ensure_peer_server()
    port = free_port()
    return Server([PEER_PY, "-m", "llama_cpp.server", "--model", model, "--model_alias", SERVED_NAME,
                   "--host", "127.0.0.1", "--port", str(port), "--n_threads", str(threads),
                   "--n_threads_batch", str(threads), "--n_ctx", str(n_ctx), "--interrupt_requests", "False"],
                  url=f"http://127.0.0.1:{port}")


# ---- load ----

async def one_request(client, prompt, n, extra):
    """Streams one completion; returns (time to first token, the gaps between tokens, tokens)."""
    start = time.perf_counter()
    stamps = []
    stream = await client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=n, temperature=0,
                                             stream=True, extra_body=extra)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
    if not stamps:
        raise RuntimeError("a request streamed no text")
    return stamps[0] - start, [b - a for a, b in zip(stamps, stamps[1:])], stamps[-1] - stamps[0]


async def run_load(url, prompts, clients, per_client, n, extra):
    import openai
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=3600, max_retries=0) as client:
        await one_request(client, prompts[0], 4, extra)  # warm-up

        async def user(u):
            return [await one_request(client, prompts[(u * per_client + k) % len(prompts)], n, extra)
                    for k in range(per_client)]
        start = time.perf_counter()
        results = [r for rs in await asyncio.gather(*[user(u) for u in range(clients)]) for r in rs]
        wall = time.perf_counter() - start
    ttft = [r[0] for r in results]
    tpot = [r[2] / (n - 1) for r in results if n > 1]  # mean gap between a request's tokens
    return {"clients": clients, "requests": len(results), "wall_s": wall,
            "throughput_tok_s": len(results) * n / wall,
            "ttft_p50_s": statistics.median(ttft), "ttft_p90_s": _quantile(ttft, 0.9),
            "itl_p50_s": statistics.median(tpot) if tpot else None,
            "itl_p90_s": _quantile(tpot, 0.9) if tpot else None}


def _quantile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def bare_request(http, url, prompt, n):
    """Streams one completion reading only the SSE lines (no JSON, no response objects): what
    the server sends, less the openai client's own work per chunk on the same cores."""
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True,
            "ignore_eos": True}
    chunks = 0
    async with http.stream("POST", f"{url}/v1/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            chunks += line.startswith("data: {")
    if not chunks:
        raise RuntimeError("a request streamed nothing")


def one_client_pairs(llm, url, prompts, n, pairs):
    """The server's single-stream tokens/s against LLM.generate's in this process, run in turns
    (one request each, prompt and generation as one client sees them, a new prompt each turn)
    so both meet the same memory phases; the median of the per-turn ratios. Each turn streams
    once through the openai client and once through a bare SSE reader (the openai client's
    parsing costs CPU on the same two cores the engine computes on)."""
    import ferrum
    import httpx2
    import openai
    params = ferrum.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    llm.generate([prompts[0]], ferrum.SamplingParams(max_tokens=4, temperature=0))

    async def turns():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=3600, max_retries=0) as client, \
                httpx2.AsyncClient(timeout=3600) as http:
            await one_request(client, prompts[0], 4, {"ignore_eos": True})
            await bare_request(http, url, prompts[0], 4)
            rates = []
            for i in range(pairs):
                prompt = prompts[1 + i]
                start = time.perf_counter()
                llm.generate([prompt], params)
                generate = n / (time.perf_counter() - start)
                start = time.perf_counter()
                await one_request(client, prompt, n, {"ignore_eos": True})
                server = n / (time.perf_counter() - start)
                start = time.perf_counter()
                await bare_request(http, url, prompt, n)
                rates.append((generate, server, n / (time.perf_counter() - start)))
            return rates
    rates = asyncio.run(turns())
    return {"pairs": pairs, "llm_generate_tok_s": statistics.median(g for g, _, _ in rates),
            "server_tok_s": statistics.median(s for _, s, _ in rates),
            "ratio": statistics.median(s / g for g, s, _ in rates),
            "bare_reader_tok_s": statistics.median(b for _, _, b in rates),
            "bare_reader_ratio": statistics.median(b / g for g, _, b in rates)}


async def structured_cost(url, clients):
    """Constrained chat requests at `clients` concurrency; the masks' cost from /metrics."""
    import openai

    def mask_counters():
        text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
        get = lambda name: float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))  # noqa: E731
        return get("ferrum:structured_output_mask_steps"), get("ferrum:structured_output_mask_seconds")

    steps0, seconds0 = mask_counters()
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", timeout=3600, max_retries=0) as client:
        replies = await asyncio.gather(*[client.chat.completions.create(
            model=SERVED_NAME, messages=[{"role": "user", "content": f"Person number {i} as JSON."}],
            max_tokens=96, temperature=0.7, seed=i,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
            for i in range(clients)])
    parsed = sum(1 for r in replies if _is_json(r.choices[0].message.content))
    steps1, seconds1 = mask_counters()
    steps = steps1 - steps0
    return {"clients": clients, "parsed": parsed, "mask_steps": steps,
            "mask_ms_per_step": 1000 * (seconds1 - seconds0) / steps if steps else None}


def _is_json(text):
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


# ---- report ----

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=None, help="GGUF (default: SmolLM2-135M-Instruct Q4_1)")
    ap.add_argument("-c", "--concurrency", default="1,8,32", help="client counts (default: 1,8,32)")
    ap.add_argument("-r", "--requests-per-client", type=int, default=2)
    ap.add_argument("-p", "--prompt-tokens", type=int, default=128)
    ap.add_argument("-n", "--max-tokens", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=8,
                    help="single requests to the server and LLM.generate, in turns (default: 8; 0: none)")
    ap.add_argument("--no-peer", action="store_true", help="ferrum only")
    ap.add_argument("--no-structured", action="store_true", help="skip the structured-output run")
    ap.add_argument("--out", default=None, help="also write every figure to this JSON file")
    a = ap.parse_args()
    sys.path.insert(0, os.path.join(HERE, "..", "python"))
    from ferrum.models import resolve_model
    from ferrum.tokenizer import Tokenizer
    from ferrum import _core
    model = str(resolve_model(a.model))
    concurrency = [int(c) for c in a.concurrency.split(",")]
    n_ctx = max(a.prompt_tokens + a.max_tokens, 192) + 64  # room for the structured-output requests too
    prompts = make_prompts(Tokenizer.from_gguf_metadata(_core.gguf_metadata(model)),
                           max(max(concurrency) * a.requests_per_client, a.pairs + 1), a.prompt_tokens)
    load_at_start = [round(x, 2) for x in os.getloadavg()]

    results = {"ferrum": {}, "llama.cpp": {}}
    import ferrum
    llm = ferrum.LLM(model, num_threads=a.threads, max_model_len=n_ctx)  # idle while the servers run
    one_client = None
    servers = [("ferrum", start_ferrum, {"ignore_eos": True})]
    if not a.no_peer:
        servers.append(("llama.cpp", start_llamacpp, {"min_tokens": a.max_tokens}))
    structured = None
    for name, start, extra in servers:
        server = start(model, a.threads, n_ctx)
        try:
            for c in concurrency:
                r = asyncio.run(run_load(server.url, prompts, c, a.requests_per_client, a.max_tokens, extra))
                results[name][c] = r
                print(f"{name:10} {c:3} clients: {r['throughput_tok_s']:7.1f} tok/s  TTFT p50 {r['ttft_p50_s'] * 1e3:8.1f} ms"
                      f"  ITL p50 {r['itl_p50_s'] * 1e3 if r['itl_p50_s'] else float('nan'):6.1f} ms", flush=True)
            if name == "ferrum" and a.pairs:
                one_client = one_client_pairs(llm, server.url, prompts, a.max_tokens, a.pairs)
                print(f"ferrum       1 client in turns with LLM.generate: {one_client['server_tok_s']:.1f} vs "
                      f"{one_client['llm_generate_tok_s']:.1f} tok/s, ratio {one_client['ratio']:.2f} "
                      f"(bare SSE reader {one_client['bare_reader_ratio']:.2f})", flush=True)
            if name == "ferrum" and not a.no_structured:
                structured = asyncio.run(structured_cost(server.url, 8))
        finally:
            server.stop()

    print(f"\nmodel: {os.path.basename(model)}  threads: {a.threads}  prompt {a.prompt_tokens} tokens, "
          f"{a.max_tokens} generated, {a.requests_per_client} requests per client  load at start: {load_at_start}")
    print(f"{'clients':>7} | {'ferrum tok/s':>12} {'llama.cpp':>10} {'ratio':>6} | {'TTFT p50 ms':>11} {'llama.cpp':>10} "
          f"| {'ITL p50 ms':>10} {'llama.cpp':>10}")
    for c in concurrency:
        f, p = results["ferrum"][c], results["llama.cpp"].get(c)
        fmt = lambda v, scale=1.0: "-" if v is None else f"{v * scale:.1f}"  # noqa: E731
        print(f"{c:>7} | {f['throughput_tok_s']:>12.1f} {fmt(p and p['throughput_tok_s']):>10} "
              f"{fmt(p and f['throughput_tok_s'] / p['throughput_tok_s']):>6} | {f['ttft_p50_s'] * 1e3:>11.1f} "
              f"{fmt(p and p['ttft_p50_s'], 1e3):>10} | {fmt(f['itl_p50_s'], 1e3):>10} {fmt(p and p['itl_p50_s'], 1e3):>10}")
    if one_client:
        print(f"1 client, in turns with LLM.generate ({one_client['pairs']} each): the server gives "
              f"{one_client['server_tok_s']:.1f} tok/s, {100 * one_client['ratio']:.0f}% of LLM.generate's "
              f"{one_client['llm_generate_tok_s']:.1f} (median of the per-turn ratios); read by a bare SSE reader "
              f"instead of the openai client, {one_client['bare_reader_tok_s']:.1f} tok/s, "
              f"{100 * one_client['bare_reader_ratio']:.0f}%")
    if structured:
        print(f"structured output (JSON schema, {structured['clients']} clients): {structured['parsed']}/"
              f"{structured['clients']} replies parse; mask {structured['mask_ms_per_step']:.3f} ms per step "
              f"over {structured['mask_steps']:.0f} steps")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"date": datetime.date.today().isoformat(), "model": os.path.basename(model),
                       "threads": a.threads, "prompt_tokens": a.prompt_tokens, "max_tokens": a.max_tokens,
                       "requests_per_client": a.requests_per_client, "machine": platform.machine(),
                       "load_at_start": load_at_start, "one_client_vs_llm_generate": one_client, "servers": results,
                       "structured": structured}, f, indent=1)


if __name__ == "__main__":
    main()
