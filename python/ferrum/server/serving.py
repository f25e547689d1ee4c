"""What completions and chat completions share: the checks every request passes (model name,
queue room, prompt length), running a prompt through the engine with its metrics, scoring a
prompt, noticing a client that left, and the OpenAI shapes of logprobs and usage."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time
import uuid
from typing import AsyncIterator, Awaitable, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
from fastapi import Request
from fastapi.responses import Response

from ..async_llm import AsyncLLM, EngineShutDown
from ..engine import token_ids_of
from ..lora import LoRARequest
from ..outputs import CompletionDelta, Logprob, RequestDelta, StepLogprobs
from ..sampling import SamplingParams
from .errors import APIError
from .metrics import ServerMetrics
from .reply import REASONING_FORMATS, detect_reasoning
from .tool_calls import FORMATS, detect_format
from .streaming import Chunks, sse_response


class Serving:
    """The engine behind the routes, with the server's settings."""

    def __init__(self, engine: AsyncLLM, model_name: str, max_waiting_requests: int, metrics: ServerMetrics,
                 tool_call_parser: Optional[str] = None, reasoning_parser: Optional[str] = None,
                 lora_modules: Sequence[LoRARequest] = ()):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = model_name
        # Adapters served beside the base, by the name a request's `model` gives.
        self.lora_modules: Dict[str, LoRARequest] = {}
        for lora in lora_modules:
            if lora.lora_name == model_name or lora.lora_name in self.lora_modules:
                raise ValueError(f"the LoRA module name {lora.lora_name!r} is taken (by the model or another module)")
            self.lora_modules[lora.lora_name] = lora
        taken = [lora.lora_int_id for lora in lora_modules] + (engine.llm.list_loras() if engine.llm.enable_lora else [])
        self._lora_ids = itertools.count(max(taken, default=0) + 1)  # each load a fresh id
        self._lora_updates = asyncio.Lock()  # one load or unload at a time
        self.max_waiting_requests = max_waiting_requests
        self.metrics = metrics
        self.max_model_len = engine.llm.runner.max_model_len
        self.vocab_size = engine.llm.runner.config["vocab_size"]
        self.created = int(time.time())
        template = self.tokenizer.chat_template
        # Tool calls: the named format, else the template's, else Hermes' (the most common).
        if tool_call_parser is not None and tool_call_parser not in FORMATS:
            raise ValueError(f"tool_call_parser must be one of {sorted(FORMATS)}, got {tool_call_parser!r}")
        self.tool_format = FORMATS[tool_call_parser] if tool_call_parser else (detect_format(template) or FORMATS["hermes"])
        # Reasoning: the named parser, "none", else the template's markers (or none).
        names = sorted(REASONING_FORMATS) + ["none"]
        if reasoning_parser is not None and reasoning_parser not in names:
            raise ValueError(f"reasoning_parser must be one of {names}, got {reasoning_parser!r}")
        self.reasoning_format = (detect_reasoning(template) if reasoning_parser is None
                                 else REASONING_FORMATS.get(reasoning_parser))

    # ---- checks ----
    def check_model(self, name: Optional[str], lora_scale: Optional[float] = None) -> None:
        """404 for a model not served; 400 for a lora_scale without an adapter or out of range."""
        if name is not None and name != self.model_name and name not in self.lora_modules:
            raise APIError(404, f"The model `{name}` does not exist.", "model")
        self.lora_for(name, lora_scale)

    def lora_for(self, name: Optional[str], lora_scale: Optional[float] = None) -> Optional[LoRARequest]:
        """The adapter a request's `model` names (None: the base model), at the request's
        lora_scale when given; 404 for an adapter unloaded since check_model, so that its request
        never runs on the base instead."""
        if name is None or name == self.model_name:
            if lora_scale is not None:
                raise APIError(400, "lora_scale needs a LoRA adapter, named by `model`", "lora_scale")
            return None
        if name not in self.lora_modules:
            raise APIError(404, f"The model `{name}` does not exist.", "model")
        lora = self.lora_modules[name]
        if lora_scale is None:
            return lora
        try:
            return dataclasses.replace(lora, scale=lora_scale)
        except ValueError as e:
            raise APIError(400, str(e), "lora_scale") from None

    # ---- adapters loaded and unloaded while serving (vLLM's /v1/load_lora_adapter) ----
    async def load_lora(self, name: str, path: str, load_inplace: bool = False) -> None:
        """Loads the adapter at `path` now and serves it as `name` (with `load_inplace`, in place
        of the one served under that name, which requests already running keep). It gets an id
        no adapter had, so a file changed since an earlier load under this name is read afresh
        (and its prefix-cache blocks are those of its own content). 400 for a name in use or a
        bad adapter (then what was served under the name still is)."""
        if not name or not path:
            raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.")
        async with self._lora_updates:
            if name == self.model_name:
                raise APIError(400, f"The name '{name}' is the base model's.", "lora_name")
            replaced = self.lora_modules.get(name)
            if replaced is not None and not load_inplace:
                raise APIError(400, f"The lora adapter '{name}' has already been loaded.", "lora_name")
            lora = LoRARequest(name, next(self._lora_ids), path)
            try:
                await self.engine.add_lora(lora)
                self.lora_modules[name] = lora
                if replaced is not None:
                    await self.engine.remove_lora(replaced.lora_int_id)
            except (ValueError, OSError) as e:  # the loader's message: what is wrong with the file
                raise APIError(400, str(e), "lora_path") from None
            except EngineShutDown:
                raise APIError(503, "The server is shutting down.") from None

    async def unload_lora(self, name: str) -> None:
        """Stops serving adapter `name` and drops it from the engine's cache; requests already
        running with it finish with it. 404 for a name not served."""
        if not name:
            raise APIError(400, "'lora_name' needs to be provided to unload a LoRA adapter.")
        async with self._lora_updates:
            lora = self.lora_modules.pop(name, None)
            if lora is None:
                raise APIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
            try:
                await self.engine.remove_lora(lora.lora_int_id)
            except EngineShutDown:
                pass  # nothing runs anymore, with it or without

    def check_room(self) -> None:
        """503 while the waiting queue is full."""
        if self.engine.stats()["waiting_requests"] >= self.max_waiting_requests:
            raise APIError(503, f"The server is busy: {self.max_waiting_requests} requests are waiting. Retry later.")

    def prompt_ids(self, prompt: Union[str, Sequence[int]], add_special_tokens: bool = True) -> List[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        try:
            ids = token_ids_of(prompt)
        except (TypeError, ValueError) as e:
            raise APIError(400, f"invalid prompt token ids: {e}", "prompt") from None
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is out of range [0, {self.vocab_size})", "prompt")
        return ids

    def check_length(self, prompt_ids: List[int], max_tokens: Optional[int]) -> None:
        """400 unless the prompt and the completion fit the context (as vLLM answers) and the KV cache."""
        if not prompt_ids:
            raise APIError(400, "the prompt is empty", "prompt")
        total = len(prompt_ids) + (max_tokens or 0)
        if len(prompt_ids) >= self.max_model_len or total > self.max_model_len:
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                f"you requested {total} tokens ({len(prompt_ids)} in the prompt, "
                                f"{max_tokens or 0} for the completion). Please reduce the length.", "prompt")
        try:  # before a streamed reply starts, so that it is a 400 too
            self.engine.llm.engine.check_fits(len(prompt_ids), max_tokens)
        except ValueError as e:
            raise APIError(400, str(e), "max_tokens") from None

    # ---- running requests ----
    async def generate(self, prompt_ids: List[int], params: SamplingParams,
                       lora: Optional[LoRARequest] = None) -> AsyncIterator[RequestDelta]:
        """The engine's deltas for one prompt (with the adapter `lora`), feeding the metrics;
        leaving early aborts it."""
        timer = self.metrics.request(len(prompt_ids), lora.name if lora else self.model_name)
        reasons: List[Optional[str]] = []
        try:
            async with contextlib.aclosing(self.engine.generate(prompt_ids, params, random_id("req"), lora_request=lora)) as deltas:
                async for delta in deltas:
                    counts = [len(d.token_ids) for d in delta.outputs]
                    timer.tokens(sum(counts), max(counts, default=0))
                    if delta.finished:
                        reasons = [o.finish_reason for o in delta.output.outputs]
                    yield delta
        except ValueError as e:  # the engine refused the request
            raise APIError(400, str(e)) from None
        except EngineShutDown:
            raise APIError(503, "The server is shutting down.") from None
        finally:
            timer.finished(reasons or ["abort"] * params.n)

    async def prompt_logprobs(self, prompt_ids: List[int], top: int,
                              lora: Optional[LoRARequest] = None) -> List[Optional[StepLogprobs]]:
        """Each prompt token's logprob given the tokens before it, and the `top` most likely
        there, from a teacher-forced score with f32 activations (as ``ferrum.eval`` scores);
        None for the first token."""
        collector = PromptLogprobs(prompt_ids, top)
        if len(prompt_ids) > 1:
            try:
                # the last token is only predicted
                await self.engine.score(prompt_ids[:-1], collector, lora_request=lora)
            except ValueError as e:
                raise APIError(400, str(e)) from None
            except EngineShutDown:
                raise APIError(503, "The server is shutting down.") from None
        return collector.entries

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def completion_logprobs(self, token_ids: Sequence[int], steps: Sequence[Optional[StepLogprobs]],
                            offset: int = 0) -> dict:
        """The completions API's logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
        tokens = [self.token_text(t) for t in token_ids]
        offsets = list(np.cumsum([offset] + [len(t) for t in tokens[:-1]]).tolist()) if tokens else []
        return {
            "tokens": tokens,
            "token_logprobs": [None if s is None else s[t].logprob for t, s in zip(token_ids, steps)],
            "top_logprobs": [None if s is None else {self.token_text(k): v.logprob for k, v in s.items()}
                             for s in steps],
            "text_offset": offsets,
        }

    def chat_logprobs(self, token_ids: Sequence[int], steps: Sequence[StepLogprobs], top: int) -> List[dict]:
        """Chat completions' ``logprobs.content`` entries."""
        def entry(token: int, lp: Logprob) -> dict:
            text = self.token_text(token)
            return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8"))}
        out = []
        for token, step in zip(token_ids, steps):
            ranked = sorted(step.items(), key=lambda kv: kv[1].rank or 0)[:top]
            out.append({**entry(token, step[token]), "top_logprobs": [entry(t, lp) for t, lp in ranked]})
        return out


class PromptLogprobs:
    """A score's consumer: per row (position p, predicting token p + 1) that token's logprob and
    the `top` most likely tokens, in float32 as ``ferrum.scoring.LogprobCollector`` computes
    them, so a sum over a continuation equals ``ferrum.eval.loglikelihood``'s."""

    def __init__(self, token_ids: List[int], top: int):
        self.targets = np.asarray(token_ids, dtype=np.int64)
        self.top = top
        self.entries: List[Optional[StepLogprobs]] = [None] * len(token_ids)

    def __call__(self, positions: np.ndarray, logits: np.ndarray) -> None:
        peak = logits.max(axis=1)
        log_norm = peak + np.log(np.exp(logits - peak[:, None]).sum(axis=1, dtype=np.float64))
        rows = np.arange(len(positions))
        targets = self.targets[positions + 1]
        picked = logits[rows, targets]
        ranks = (logits > picked[:, None]).sum(axis=1) + 1
        k = min(self.top, logits.shape[1])
        if k:
            best = np.argpartition(-logits, k - 1, axis=1)[:, :k]
            best_logits = logits[rows[:, None], best]
            order = np.lexsort((best, -best_logits), axis=1)  # most likely first, ties by id
            best = np.take_along_axis(best, order, axis=1)
        logprob = lambda row, t: float(np.float32(logits[row, t] - log_norm[row]))  # noqa: E731
        for row, p in enumerate(positions):
            entry = {int(targets[row]): Logprob(logprob(row, targets[row]), int(ranks[row]))}
            for r in range(k):
                entry.setdefault(int(best[row, r]), Logprob(logprob(row, best[row, r]), r + 1))
            self.entries[p + 1] = entry


async def merged(streams: Sequence[AsyncIterator]) -> AsyncIterator[Tuple[int, object]]:
    """Items of several async iterators as they come, each with its iterator's index; leaving
    early, or one of them failing, closes them all."""
    queue: asyncio.Queue = asyncio.Queue()
    ended = object()

    async def pump(i: int, stream: AsyncIterator) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for item in stream:
                    await queue.put((i, item, None))
        except Exception as e:
            await queue.put((i, None, e))
        else:
            await queue.put((i, ended, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, error = await queue.get()
            if error is not None:
                raise error
            if item is ended:
                remaining -= 1
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def stream_chunks(event: Chunks, streams: Sequence[AsyncIterator[RequestDelta]],
                        choice: Callable[[int, CompletionDelta], dict], prompt_tokens: int) -> AsyncIterator[str]:
    """A chunk for each engine step in which the requests of `streams` produced text, tokens or an
    end, with a choice per completion made by ``choice(stream index, its delta)``; then the
    usage chunk, when the request asked for it."""
    completion_tokens = 0
    async for i, delta in merged(streams):
        choices = []
        for d in delta.outputs:
            completion_tokens += len(d.token_ids)
            if d.text or d.token_ids or d.finish_reason:
                choices.append(choice(i, d))
        if choices:
            yield event(choices)
    if event.include_usage:
        yield event([], usage(prompt_tokens, completion_tokens))


async def reply(request: Request, id_prefix: str, model_name: str, stream: bool,
                streamed: Callable[[dict], AsyncIterator[str]], whole: Callable[[dict], Awaitable[dict]]):
    """The response: the events of ``streamed(header)`` as a stream, or the body ``whole(header)``
    returns (nothing if the client left first); header: the id, created time and model."""
    header = {"id": random_id(id_prefix), "created": int(time.time()), "model": model_name}
    if stream:
        return sse_response(request, streamed(header))
    result = await unless_disconnected(request, whole(header))
    return Response(status_code=204) if result is None else result


async def unless_disconnected(request: Request, work):
    """Runs the coroutine `work` unless the client leaves first, in which case it is cancelled
    (aborting its requests) and None is returned."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return None
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> Dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
