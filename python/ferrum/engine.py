"""Requests over the C++ engine (``ferrum._core.Engine``).

C++ owns the sequences, their tokens and the scheduling: token budget, chunked prefill mixed with
decodes in one varlen forward, paged KV blocks taken as sequences grow, prefix-cache adoption,
preemption of the youngest sequence (recomputed later) when the pool runs out. Each ``step()``
here runs one forward there and handles the rows it returns, each tagged with its sequence and
position: a generation's row is sampled (numpy, one generator per completion), its token handed
back and turned into a text delta (stop strings and detokenisation stay in Python; a completion
that stops tells C++ so, which frees its blocks, full ones staying in the prefix cache); a score's
rows go to its consumer, and the score ends by itself with its last rows.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import numpy as np

from . import _core
from .outputs import CompletionDelta, RequestDelta, RequestOutput
from .sampling import Sampler, SamplingParams, SamplingState
from .stop import RequestProgress
from .tokenizer import IncrementalDecoder, Tokenizer


@dataclass
class _Completion:
    """One of a request's ``n`` completions; ``seq`` is its C++ sequence. Its generated tokens
    are one list, ``progress.token_ids``, which the sampling state reads too."""
    request_id: str
    index: int
    seq: int
    state: SamplingState
    progress: RequestProgress
    decoder: IncrementalDecoder


def token_ids_of(ids) -> List[int]:
    """Token ids as a list of ints. TypeError unless they are integers; their values are checked
    against the vocabulary once, by the engine, when a request is admitted."""
    arr = np.asarray(ids)
    if arr.size == 0:
        return []
    if arr.ndim != 1:
        raise TypeError(f"token ids must be a flat sequence of integers, got shape {arr.shape}")
    if arr.dtype.kind == "O" and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError(f"token id {max(ids, key=abs)} is out of range")  # beyond 64 bits
    if arr.dtype.kind not in "iu":
        raise TypeError(f"token ids must be integers, got {arr.dtype} values")
    return arr.tolist()


# consume(positions int64[k], rows float32[k, width]): one sequence's rows of a step (logits, or
# an embedding's hidden states), in position order.
RowConsumer = Callable[[np.ndarray, np.ndarray], None]


@dataclass
class _Request:
    request_id: str
    prompt: Optional[str]
    prompt_ids: List[int]
    completions: List[_Completion]
    deltas: Dict[int, CompletionDelta] = field(default_factory=dict)  # this step's, by index

    def output(self) -> RequestOutput:
        outs = [c.progress.to_output() for c in self.completions]
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_ids), outs,
                             finished=all(c.progress.finished for c in self.completions))

    def note(self, c: _Completion, text: str, token: Optional[int] = None) -> None:
        d = self.deltas.setdefault(c.index, CompletionDelta(c.index, "", []))
        d.text += text
        if token is not None:
            d.token_ids.append(token)
        d.finish_reason, d.stop_reason = c.progress.finish_reason, c.progress.stop_reason


class Engine:
    def __init__(self, runner, tokenizer: Tokenizer, max_num_seqs: int = 32,
                 max_num_batched_tokens: int = 512):
        for name, v in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        self.runner = runner
        self.tokenizer = tokenizer
        self.core = _core.Engine(runner, max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=max_num_batched_tokens)
        self.sampler = Sampler()
        self._requests: Dict[str, _Request] = {}
        self._by_seq: Dict[int, _Completion] = {}
        self._consumers: Dict[int, RowConsumer] = {}  # scores' and embeddings' rows
        self._ids = itertools.count()

    # ---- requests ----
    def add_request(self, prompt_ids: List[int], params: SamplingParams, prompt: Optional[str] = None,
                    request_id: Optional[str] = None) -> str:
        """Queues a request (its ``params.n`` completions); ValueError when it could never run."""
        if not isinstance(params, SamplingParams):
            raise TypeError("sampling params must be a ferrum.SamplingParams")
        prompt_ids = token_ids_of(prompt_ids)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        req = _Request(request_id, prompt, prompt_ids, [])
        try:
            for i in range(params.n):
                seq = self.core.add_sequence(prompt_ids)
                progress = RequestProgress(params, self.tokenizer.eos_token_ids, index=i)
                state = SamplingState(params, prompt_ids, index=i, output_token_ids=progress.token_ids)
                req.completions.append(_Completion(
                    request_id, i, seq, state, progress,
                    IncrementalDecoder(self.tokenizer, params.skip_special_tokens)))
        except BaseException:
            for c in req.completions:
                self.core.abort(c.seq)
            raise
        for c in req.completions:
            self._by_seq[c.seq] = c
        self._requests[request_id] = req
        return request_id

    def abort(self, request_id: str) -> Optional[RequestDelta]:
        """Ends a request wherever it is (waiting, mid-prompt, decoding) and frees its blocks.
        Returns its final delta (finish_reason "abort"), or None for an unknown or finished id."""
        req = self._requests.get(str(request_id))
        if req is None:
            return None
        for c in req.completions:
            self.core.abort(c.seq)
            self._by_seq.pop(c.seq, None)
            if not c.progress.finished:
                req.note(c, c.progress.finish("abort"))
        return self._delta(req)

    def add_score(self, token_ids: List[int], rows_from: int, consume: RowConsumer, embed: bool = False) -> int:
        """Queues a score of `token_ids`: the logits at positions ``rows_from ..`` (each
        predicting the next token), or with `embed` the final hidden states there, go to
        ``consume`` as steps compute them, with f32 activations. Returns its sequence;
        ``score_finished(seq)`` tells when it is done. ValueError when it could never run."""
        seq = self.core.add_score(token_ids, rows_from, embed)
        self._consumers[seq] = consume
        return seq

    def score_finished(self, seq: int) -> bool:
        return seq not in self._consumers

    def abort_score(self, seq: int) -> None:
        self.core.abort(seq)
        self._consumers.pop(seq, None)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    # ---- one step ----
    def step(self) -> List[RequestDelta]:
        """Runs one forward; hands score rows to their consumers and returns what each
        generation request that changed produced in it."""
        out = self.core.step()
        touched: Dict[str, _Request] = {}
        for seq in out["ended"]:  # the KV pool is full and this one alone holds it
            self._end(seq, "length", touched)
        self._hand_out_rows(out)
        # (a row whose request another thread aborted meanwhile is dropped)
        rows = [int(i) for i in out["sample_rows"] if int(out["seqs"][i]) in self._by_seq]
        if rows:
            seqs = [int(out["seqs"][i]) for i in rows]
            comps = [self._by_seq[s] for s in seqs]
            logits = out["logits"] if len(rows) == len(out["logits"]) else out["logits"][np.asarray(rows)]
            result = self.sampler.sample(logits, [c.state for c in comps])
            tokens = [int(t) for t in result.token_ids]
            finished = []
            for c, tok, lp in zip(comps, tokens, result.logprobs):
                emit, done, _ = c.progress.append(tok, c.decoder.push(tok), lp)
                finished.append(done)
                req = self._requests[c.request_id]
                req.note(c, emit, tok)
                touched[req.request_id] = req
                if done:
                    del self._by_seq[c.seq]
            for seq in self.core.commit(seqs, tokens, finished):  # reached max_model_len
                self._end(seq, "length", touched)
        return [self._delta(req) for req in touched.values()]

    def _hand_out_rows(self, out: dict) -> None:
        """Hands each score or embedding its rows of this step (one contiguous run each: logits
        rows first, then hidden-state rows)."""
        seqs, logit_rows = out["seqs"], len(out["logits"])
        i = 0
        while i < len(seqs):
            j = i + 1
            while j < len(seqs) and seqs[j] == seqs[i]:
                j += 1
            consume = self._consumers.get(int(seqs[i]))
            if consume is not None:
                rows = out["logits"][i:j] if i < logit_rows else out["hidden"][i - logit_rows:j - logit_rows]
                consume(out["positions"][i:j], rows)
            i = j
        for seq in out["scored"]:
            self._consumers.pop(seq, None)

    def _end(self, seq: int, reason: str, touched: Dict[str, _Request]) -> None:
        if seq in self._consumers:  # a score fits the pool whole by admission: never ended
            raise RuntimeError(f"the engine ended score sequence {seq}")
        c = self._by_seq.pop(seq)
        req = self._requests[c.request_id]
        req.note(c, c.progress.finish(reason))
        touched[req.request_id] = req

    def _delta(self, req: _Request) -> RequestDelta:
        delta = RequestDelta(req.request_id, [req.deltas[i] for i in sorted(req.deltas)])
        req.deltas = {}
        if all(c.progress.finished for c in req.completions):
            delta.finished, delta.output = True, req.output()
            del self._requests[req.request_id]
        return delta

    def stats(self) -> dict:
        st = dict(self.runner.stats())
        st.update(self.core.stats())
        q = st.get("prefix_query_tokens", 0)
        st["prefix_cache_hit_rate"] = st.get("prefix_hit_tokens", 0) / q if q else 0.0
        busy = st["busy_seconds"]
        st["generation_tokens_per_s"] = st["generated_tokens"] / busy if busy > 0 else 0.0
        return st
