"""What the agent routes of ``ferrum serve`` cost, side by side in one run:

* tool calls: a ``tool_choice: "required"`` chat request (held by the tools' llguidance grammar)
  vs an unconstrained completion of the same prompt tokens and the same number of generated
  tokens, per generated token (each minus a 1-token request's time, the prefill; prefix caching
  off, so every prefill is computed); and ``tool_choice: "auto"`` with no call made (the lazy
  grammar only watching);
* embeddings: ``/v1/embeddings`` with a batch of short inputs (the `openai` client) vs
  ``LLM.embed`` on the same inputs in the same process.

The measurements alternate, pair by pair, so a machine shared with other work slows both alike.

usage: python bench/agent_bench.py [MODEL] [-t 2] [--pairs 6] [--batch 64] [--out FILE.json]
"""
import argparse
import contextlib
import json
import statistics
import threading
import time

import openai
import uvicorn

import ferrum
from ferrum.async_llm import AsyncLLM
from ferrum.server.app import build_app
from ferrum.structured import MASK_COST

NAME = "bench"
TOOLS = [
    {"type": "function", "function": {
        "name": "book_trip", "description": "Books a trip",
        "parameters": {"type": "object", "properties": {
            "from_city": {"type": "string", "minLength": 24, "maxLength": 24},
            "to_city": {"type": "string", "minLength": 24, "maxLength": 24},
            "travellers": {"type": "integer", "minimum": 1, "maximum": 9},
            "class": {"enum": ["economy", "business", "first"]}},
            "required": ["from_city", "to_city", "travellers", "class"]}}},
    {"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 24}}, "required": ["city"]}}},
]
QUESTIONS = ["Book me a trip from Lisbon to Oslo for two in business class.",
             "I need to travel from Madrid to Vienna, three people, economy.",
             "Get me from Athens to Dublin, first class, one traveller.",
             "Two of us want to fly from Rome to Prague in economy."]
SHORT_TEXTS = ["The quick brown fox", "jumps over the lazy dog", "A cup of tea", "Rain in Spain",
               "Hello world", "Where is the station?", "Open the window", "Twelve apples"]


@contextlib.contextmanager
def serving(llm):
    engine = AsyncLLM(llm)
    server = uvicorn.Server(uvicorn.Config(build_app(engine, NAME), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.05)
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        engine.shutdown()


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def tool_cost(url, client, pairs):
    """Per generated token: seconds of a required call, of the same-length unconstrained
    completion, and of an auto request that makes no call."""
    import requests
    rows, expected_tokens = [], {}
    for i in range(pairs):
        q = (i // 2) % len(QUESTIONS)  # each question twice: the required call first, then second
        messages = [{"role": "user", "content": QUESTIONS[q]}]
        ids = requests.post(f"{url}/tokenize", json={"messages": messages, "tools": TOOLS}, timeout=60).json()["tokens"]

        def required():
            return timed(lambda: client.chat.completions.create(
                model=NAME, messages=messages, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                temperature=0, max_tokens=200))

        def free(k):
            return timed(lambda: client.completions.create(model=NAME, prompt=ids, max_tokens=k, temperature=0,
                                                           extra_body={"ignore_eos": True}))[0]
        prefill, _ = timed(lambda: client.completions.create(model=NAME, prompt=ids, max_tokens=1, temperature=0))
        if i % 2:  # the order alternates, so a load that drifts during a pair weighs on both alike
            t_free = free(expected_tokens[q])
            t_tool, reply = required()
        else:
            t_tool, reply = required()
        k = reply.usage.completion_tokens
        assert reply.choices[0].finish_reason == "tool_calls" and k < 200, reply
        assert reply.usage.prompt_tokens == len(ids)
        if i % 2 == 0:
            expected_tokens[q] = k
            t_free = free(k)
        assert k == expected_tokens[q]  # greedy: the same call each time
        t_auto, auto = timed(lambda: client.chat.completions.create(
            model=NAME, messages=messages, tools=TOOLS, temperature=0, max_tokens=k,
            extra_body={"ignore_eos": True, "logit_bias": _no_call_bias(client, url)}))
        assert auto.choices[0].message.tool_calls is None
        per = lambda t, n=k: (t - prefill) / (n - 1)  # noqa: E731
        rows.append({"tokens": k, "required_s": per(t_tool), "free_s": per(t_free),
                     "auto_s": per(t_auto, auto.usage.completion_tokens)})
    return rows


_BIAS = {}


def _no_call_bias(client, url):
    """logit_bias keeping "<tool_call>"'s first token out, so the auto request makes no call."""
    import requests
    if not _BIAS:
        first = requests.post(f"{url}/tokenize", json={"prompt": "<tool_call>", "add_special_tokens": False},
                              timeout=30).json()["tokens"][0]
        _BIAS[str(first)] = -100
    return _BIAS


def embed_cost(url, client, llm_ref, batch, pairs):
    texts = [f"{SHORT_TEXTS[i % len(SHORT_TEXTS)]} #{i}" for i in range(batch)]
    rows = []
    for _ in range(pairs):
        t_http, got = timed(lambda: client.embeddings.create(model=NAME, input=texts))
        t_llm, want = timed(lambda: llm_ref.embed(texts))
        assert [d.embedding for d in got.data] == [o.outputs.embedding for o in want]
        rows.append({"http_s": t_http, "llm_s": t_llm})
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=None, help="default: SmolLM2-135M-Instruct Q4_1")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    kw = dict(num_threads=args.threads, max_model_len=1024, enable_prefix_caching=False)
    llm = ferrum.LLM(args.model, **kw)
    ref = ferrum.LLM(args.model, **kw)  # LLM.embed's own instance, idle while the server works
    with serving(llm) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                       tool_choice="required", max_tokens=200)  # warm: the grammar's first build
        mask_before = MASK_COST.snapshot()
        tools = tool_cost(url, client, args.pairs)
        mask = {k: MASK_COST.snapshot()[k] - mask_before[k] for k in mask_before}
        embeds = embed_cost(url, client, ref, args.batch, args.pairs)
    total = lambda rows, key: sum(r[key] for r in rows)  # noqa: E731
    result = {
        "model": str(llm.model_path), "threads": args.threads, "pairs": args.pairs,
        "tool_tokens": [r["tokens"] for r in tools],
        "per_token_ms": {k: 1e3 * statistics.mean(r[k] for r in tools) for k in ("free_s", "required_s", "auto_s")},
        "required_vs_free": total(tools, "required_s") / total(tools, "free_s"),
        "auto_vs_free": total(tools, "auto_s") / total(tools, "free_s"),
        "mask_ms_per_step": 1e3 * mask["seconds"] / max(mask["steps"], 1),
        "embed_batch": args.batch,
        "embed_http_s": statistics.median(r["http_s"] for r in embeds),
        "embed_llm_s": statistics.median(r["llm_s"] for r in embeds),
        "embed_http_vs_llm": total(embeds, "http_s") / total(embeds, "llm_s"),
    }
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
