"""An asyncio front for ``LLM``: one background thread drives the engine, coroutines stream.

``AsyncLLM.generate`` is an async generator of ``RequestDelta``s (vLLM's ``AsyncLLM.generate``
with DELTA outputs): the request joins the running batch at the next step, each step's progress
comes back through the event loop that asked, and leaving the loop early (``break``, a
cancelled task, a client gone) aborts the request and frees its KV blocks.

Only the engine thread touches the engine: coroutines hand it commands through an inbox, so the
event loop never waits for a forward to end. While an ``AsyncLLM`` runs, use its ``LLM`` only
through it.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import threading
from typing import AsyncIterator, Callable, Dict, List, Optional, Sequence, Tuple, Union

from .engine import RowConsumer
from .llm import LLM
from .outputs import RequestDelta
from .sampling import SamplingParams


class EngineShutDown(RuntimeError):
    """The AsyncLLM was shut down: it takes no more requests."""


class AsyncLLM:
    """Wraps a loaded ``LLM`` (``AsyncLLM(llm)``), or loads one (``AsyncLLM.load(model, **kw)``
    with ``LLM``'s arguments). ``shutdown()`` stops the engine thread, as leaving an
    ``async with`` block does."""

    def __init__(self, llm: LLM):
        if not isinstance(llm, LLM):
            raise TypeError(f"AsyncLLM wraps a ferrum.LLM, got {type(llm).__name__}")
        self.llm = llm
        self._cv = threading.Condition()
        # Guarded by _cv:
        self._inbox: List[Callable[[], None]] = []  # commands for the engine thread, in order
        self._streams: Dict[str, Tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}  # by request id
        self._unadmitted = 0  # requests queued that the last stats do not count yet
        self._stats: dict = llm.stats()
        self._stopping = False  # shutdown() asked
        self._closed = False  # the engine thread takes no more commands
        # The engine thread's own:
        self._admitted = 0  # requests added since the last stats
        self._scores: Dict[concurrent.futures.Future, int] = {}  # running scores' sequences
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="ferrum-engine", daemon=True)
        self._thread.start()

    @classmethod
    def load(cls, model=None, **llm_kwargs) -> "AsyncLLM":
        return cls(LLM(model, **llm_kwargs))

    @property
    def tokenizer(self):
        return self.llm.tokenizer

    # ---- requests ----
    async def generate(self, prompt: Union[str, Sequence[int]], sampling_params: Optional[SamplingParams] = None,
                       request_id: Optional[str] = None, lora_request=None) -> AsyncIterator[RequestDelta]:
        """Yields the request's progress step by step (new text and token ids per completion),
        the last delta ``finished`` with the whole ``RequestOutput``. ValueError (before the
        first delta) when the request could never run, as ``LLM.add_request``; EngineShutDown
        after ``shutdown()``. lora_request: a ``ferrum.LoRARequest`` (LLM(enable_lora=True))."""
        params = sampling_params or SamplingParams()
        queue: asyncio.Queue = asyncio.Queue()
        added: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._stopping:
                raise EngineShutDown("the engine is shut down")
            rid = f"req-{next(self._ids)}" if request_id is None else str(request_id)
            if rid in self._streams:
                raise ValueError(f"request id {rid!r} is already in use")
            self._streams[rid] = (asyncio.get_running_loop(), queue)
            self._inbox.append(lambda: self._admit(prompt, params, rid, added, lora_request))
            self._unadmitted += 1
            self._cv.notify()
        finished = False
        try:
            await asyncio.wrap_future(added)
            while not finished:
                # A consumer that fell behind takes the deltas waiting as one (as vLLM's
                # output collector merges them): a slow client costs fewer events, not tokens.
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                deltas = list(itertools.takewhile(lambda i: not isinstance(i, BaseException), items))
                if deltas:
                    delta = RequestDelta.merge(deltas)
                    finished = delta.finished
                    yield delta
                if len(deltas) < len(items):  # the engine failed the request
                    raise items[len(deltas)]
        finally:
            with self._cv:
                self._streams.pop(rid, None)
            if not finished:  # queued after the add, so it finds the request
                self._submit(lambda: self.llm.abort(rid))

    async def abort(self, request_id: str) -> None:
        """Stops a request wherever it is and frees its KV blocks; its generator ends with a
        delta whose finish_reason is "abort". No-op for an unknown or finished id."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        if self._submit(lambda: _settle(done, lambda: self.llm.abort(request_id))):
            await asyncio.wrap_future(done)

    async def score(self, token_ids: Sequence[int], consume: RowConsumer, rows_from: int = 0,
                    embed: bool = False, lora_request=None) -> None:
        """Teacher-forced scoring (``Engine.add_score``: f32 activations, forwards shared with the
        running batch): the logits rows at positions ``rows_from ..`` of `token_ids` (each
        predicting the next token; with `embed`, the final hidden states instead) go to
        ``consume(positions, rows)``, on the engine thread, as steps compute them; returns once all have. ValueError when it could never run;
        cancelling it aborts the score."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        token_ids = list(token_ids)
        if not self._submit(lambda: self._start_score(token_ids, rows_from, consume, done, embed, lora_request)):
            raise EngineShutDown("the engine is shut down")
        try:
            await asyncio.wrap_future(done)
        finally:
            if not done.done():  # the caller left
                self._submit(lambda: self._drop_score(done))

    # ---- LoRA adapters (LLM(enable_lora=True)) ----
    async def add_lora(self, lora_request) -> None:
        """Loads an adapter on the engine thread, between steps (``LLM.add_lora``): ValueError
        for a bad file."""
        await self._on_engine_thread(lambda: self.llm.add_lora(lora_request))

    async def remove_lora(self, lora_id: int) -> bool:
        """Drops an adapter from the cache (``LLM.remove_lora``): requests already running with
        it finish with it; False when it was not loaded."""
        return await self._on_engine_thread(lambda: self.llm.remove_lora(lora_id))

    async def _on_engine_thread(self, fn: Callable):
        done: concurrent.futures.Future = concurrent.futures.Future()
        if not self._submit(lambda: _settle(done, fn)):
            raise EngineShutDown("the engine is shut down")
        return await asyncio.wrap_future(done)

    def stats(self) -> dict:
        """``LLM.stats()`` as of the engine's last step, plus ``pending_requests`` (handed to the
        engine thread, not yet in the engine) and ``waiting_requests`` (those plus the
        scheduler's waiting sequences)."""
        with self._cv:
            st = dict(self._stats)
            st["pending_requests"] = self._unadmitted
        st["waiting_requests"] = st["pending_requests"] + st["waiting"]
        return st

    # ---- lifetime ----
    @property
    def ready(self) -> bool:
        """Whether the engine takes requests: its thread runs and no shutdown was asked."""
        with self._cv:
            return not (self._stopping or self._closed) and self._thread.is_alive()

    def shutdown(self, timeout: Optional[float] = None) -> None:
        """Stops taking requests, aborts those in flight (their generators end with "abort")
        and stops the engine thread. Idempotent."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)

    async def __aenter__(self) -> "AsyncLLM":
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.to_thread(self.shutdown)

    # ---- the engine thread ----
    def _submit(self, command: Callable[[], None]) -> bool:
        """Queues a command for the engine thread; False once that thread has ended."""
        with self._cv:
            if self._closed:
                return False
            self._inbox.append(command)
            self._cv.notify()
            return True

    def _run(self) -> None:
        while True:
            busy = self.llm.has_unfinished()
            with self._cv:
                while not (self._inbox or busy or self._stopping):
                    self._cv.wait()
                commands, self._inbox = self._inbox, []
                stopping = self._stopping
            for command in commands:
                command()
            if stopping:
                break
            self._publish_stats()
            if self.llm.has_unfinished():
                try:
                    deltas = self.llm.step()
                except Exception as e:  # every request in flight fails; the engine goes on
                    self._fail_all(e)
                else:
                    self._deliver(deltas)
                    self._settle_scores()
                self._publish_stats()
        self._close()

    def _admit(self, prompt, params: SamplingParams, rid: str, added: concurrent.futures.Future,
               lora_request=None) -> None:
        _settle(added, lambda: self.llm.add_request(prompt, params, request_id=rid, lora_request=lora_request))
        self._admitted += 1

    def _start_score(self, token_ids, rows_from: int, consume: RowConsumer, done: concurrent.futures.Future,
                     embed: bool, lora_request=None) -> None:
        if not done.set_running_or_notify_cancel():
            return
        try:
            lora = self.llm._lora_list(lora_request, 1)[0]
            self._scores[done] = self.llm.engine.add_score(token_ids, rows_from, consume, embed=embed, lora=lora)
        except Exception as e:
            done.set_exception(e)

    def _settle_scores(self) -> None:
        for done, seq in list(self._scores.items()):
            if self.llm.engine.score_finished(seq):
                del self._scores[done]
                done.set_result(None)

    def _drop_score(self, done: concurrent.futures.Future, error: Optional[BaseException] = None) -> None:
        """Aborts a running score (its caller left, or the engine failed or stops)."""
        seq = self._scores.pop(done, None)
        if seq is not None:
            self.llm.engine.abort_score(seq)
            done.set_exception(error or asyncio.CancelledError())

    def _fail_all(self, error: Exception) -> None:
        with self._cv:
            streams = dict(self._streams)
        for rid, (loop, queue) in streams.items():
            self.llm.abort(rid)
            _put(loop, queue, error)
        for done in list(self._scores):
            self._drop_score(done, error)

    def _close(self) -> None:
        """At shutdown: every request in flight ends with "abort", every score fails, and no
        command is taken after."""
        with self._cv:
            self._closed = True
            pending, self._inbox = self._inbox, []
        for command in pending:  # adds whose callers wait for them, and aborts
            command()
        with self._cv:
            ids = list(self._streams)
        for rid in ids:
            self.llm.abort(rid)
        for done in list(self._scores):
            self._drop_score(done, EngineShutDown("the engine is shut down"))
        while self.llm.has_unfinished():  # hands out the aborts' final deltas
            self._deliver(self.llm.step())
        self._publish_stats()

    def _deliver(self, deltas: List[RequestDelta]) -> None:
        """Hands each delta to its request's event loop (dropped when nobody listens anymore)."""
        with self._cv:
            targets = [(self._streams.get(d.request_id), d) for d in deltas]
        for target, delta in targets:
            if target is not None:
                _put(*target, delta)

    def _publish_stats(self) -> None:
        """New stats, which count the requests admitted since the last ones."""
        st = self.llm.stats()
        with self._cv:
            self._stats = st
            self._unadmitted -= self._admitted
        self._admitted = 0


def _put(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, item) -> None:
    with contextlib.suppress(RuntimeError):  # that event loop is closed
        loop.call_soon_threadsafe(queue.put_nowait, item)


def _settle(future: concurrent.futures.Future, fn: Callable) -> None:
    """Runs fn() and sets its result or exception on the future (unless its waiter is gone)."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn())
    except Exception as e:  # the caller sees it, not the engine thread
        future.set_exception(e)
