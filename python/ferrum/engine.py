"""Continuous batching over the C++ ModelRunner.

Every step packs the running sequences' next tokens and chunks of waiting prompts into one
varlen forward, up to a token budget. New prompts adopt cached prefix blocks first. When the
KV pool runs out, the youngest running sequence is preempted (its blocks freed) and later
recomputed from its prompt plus what it had generated, so outputs do not change.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np

from .outputs import RequestOutput
from .sampling import Sampler, SamplingParams, SamplingState
from .stop import RequestProgress
from .tokenizer import IncrementalDecoder, Tokenizer


@dataclass
class _Sequence:
    """One completion being generated (a request with n > 1 has n of them)."""
    request_id: str
    index: int
    prompt_ids: List[int]
    params: SamplingParams
    state: SamplingState
    progress: RequestProgress
    decoder: IncrementalDecoder
    arrival: int
    seq: Optional[int] = None       # runner sequence id while it holds KV
    computed: int = 0               # tokens of `tokens` whose K/V are in the cache
    tokens: List[int] = field(default_factory=list)  # prompt + generated


@dataclass
class _Request:
    request_id: str
    prompt: Optional[str]
    prompt_ids: List[int]
    sequences: List[_Sequence]
    delta_text: Dict[int, str] = field(default_factory=dict)

    def output(self) -> RequestOutput:
        outs = [s.progress.to_output() for s in self.sequences]
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_ids), outs,
                             finished=all(s.progress.finished for s in self.sequences))


class Engine:
    def __init__(self, runner, tokenizer: Tokenizer, max_num_seqs: int = 32,
                 max_num_batched_tokens: int = 512):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.runner = runner
        self.tokenizer = tokenizer
        self.max_num_seqs = max_num_seqs
        self.token_budget = max_num_batched_tokens
        self.sampler = Sampler()
        self._requests: Dict[str, _Request] = {}
        self._waiting: List[_Sequence] = []
        self._running: List[_Sequence] = []
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self._generated = 0
        self._started = time.perf_counter()
        self.num_preemptions = 0
        self._hold_admission = False

    # ---- requests ----
    def add_request(self, prompt_ids: List[int], params: SamplingParams, prompt: Optional[str] = None,
                    request_id: Optional[str] = None) -> str:
        if not isinstance(params, SamplingParams):
            raise TypeError("sampling params must be a ferrum.SamplingParams")
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise ValueError("the prompt is empty (no tokens)")
        vocab = self.runner.config["vocab_size"]
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is out of range [0, {vocab})")
        limit = self.runner.max_model_len
        if len(prompt_ids) >= limit:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; max_model_len is {limit} "
                             "(room is needed for at least one generated token)")
        stats = self.runner.stats()
        if self.runner.blocks_for(len(prompt_ids) + 1) > stats["kv_blocks_total"]:
            raise ValueError(f"the prompt ({len(prompt_ids)} tokens) can never fit in the KV cache "
                             f"({stats['kv_blocks_total'] * stats['block_size']} tokens)")
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seqs = []
        for i in range(params.n):
            seqs.append(_Sequence(
                request_id, i, prompt_ids, params,
                SamplingState(params, prompt_ids, index=i),
                RequestProgress(params, self.tokenizer.eos_token_ids, index=i),
                IncrementalDecoder(self.tokenizer, params.skip_special_tokens),
                next(self._arrivals), tokens=list(prompt_ids)))
        self._requests[request_id] = _Request(request_id, prompt, prompt_ids, seqs)
        self._waiting.extend(seqs)
        return request_id

    def abort(self, request_id: str) -> None:
        req = self._requests.pop(str(request_id), None)
        if req is None:
            return
        for s in req.sequences:
            self._drop(s)
            if not s.progress.finished:
                s.progress.finish("abort")

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running)

    # ---- one step ----
    def step(self) -> List[RequestOutput]:
        """Runs one forward and returns the requests that produced output (text deltas in
        `RequestOutput.outputs[i].text` are cumulative; `delta` text is in `.delta`)."""
        while True:
            items, owners = self._schedule()
            if not items:
                if self._running:  # the oldest cannot grow even alone
                    return self._finish_alone()
                return []
            try:
                logits = self.runner.step(items)
                self._hold_admission = False
                break
            except MemoryError:  # the block count was off: make room, admit nothing new
                self._hold_admission = True
                if not self._preempt():
                    # One sequence alone has filled the KV cache: it ends as if at its limit.
                    return self._finish_alone()
        touched: Dict[str, _Request] = {}
        sample_rows, row_seqs = [], []
        row = 0
        for (seq_id, toks, mode), s in zip(items, owners):
            s.computed += len(toks)
            if mode == "last":
                sample_rows.append(row)
                row_seqs.append(s)
                row += 1
        if row_seqs:
            result = self.sampler.sample(logits[sample_rows], [s.state for s in row_seqs])
            for i, s in enumerate(row_seqs):
                tok = int(result.token_ids[i])
                self._generated += 1
                s.state.append(tok)
                s.tokens.append(tok)
                text = s.decoder.push(tok)
                emit, finished, _ = s.progress.append(tok, text, result.logprobs[i])
                if not finished and len(s.tokens) >= self.runner.max_model_len:
                    emit += s.progress.finish("length")
                    finished = True
                req = self._requests.get(s.request_id)
                if req is None:
                    continue
                req.delta_text[s.index] = req.delta_text.get(s.index, "") + emit
                touched[s.request_id] = req
                if finished:
                    self._drop(s)
        outputs = []
        for rid, req in touched.items():
            out = req.output()
            out.delta = dict(req.delta_text)
            req.delta_text.clear()
            outputs.append(out)
            if out.finished:
                del self._requests[rid]
        return outputs

    def _schedule(self):
        """Picks this step's tokens within the token budget and the free KV blocks: decodes
        first (oldest first, preempting the youngest when blocks run out), then prompt chunks."""
        items, owners = [], []
        budget = self.token_budget
        free = self.runner.stats()["kv_blocks_free"]
        for s in sorted(self._running, key=lambda s: s.arrival):
            if budget == 0:
                break
            if s not in self._running or s.computed != len(s.tokens) - 1:
                continue
            need = self._blocks_needed(s, 1)
            while need > free and self._preempt(exclude=s):
                free = self.runner.stats()["kv_blocks_free"]
            if need > free:
                break  # only older sequences remain; they get the blocks first next step
            items.append((s.seq, [s.tokens[-1]], "last"))
            owners.append(s)
            budget -= 1
            free -= need
        for s in sorted(self._running, key=lambda s: s.arrival):
            if budget == 0:
                break
            if s.computed < len(s.tokens) - 1 and s not in owners:
                take = self._chunk_size(s, budget, free)
                if take:
                    self._add_chunk(s, take, items, owners)
                    budget -= take
                    free -= self._blocks_needed(s, take)
        while (budget > 0 and free > 0 and self._waiting and len(self._running) < self.max_num_seqs
               and not self._hold_admission):
            s = self._waiting[0]
            s.seq = self.runner.add_sequence()
            s.computed = self.runner.adopt_prefix(s.seq, s.tokens)
            free = self.runner.stats()["kv_blocks_free"]  # adopted cached blocks are no longer free
            take = self._chunk_size(s, budget, free)
            if take == 0:
                self.runner.release_sequence(s.seq)
                s.seq, s.computed = None, 0
                break
            self._waiting.pop(0)
            self._running.append(s)
            self._add_chunk(s, take, items, owners)
            budget -= take
            free -= self._blocks_needed(s, take)
        return items, owners

    def _blocks_needed(self, s: _Sequence, n: int) -> int:
        bs = self.runner.block_size
        return -(-(s.computed + n) // bs) - (-(-s.computed // bs))

    def _chunk_size(self, s: _Sequence, budget: int, free: int) -> int:
        """The most prompt tokens of s that fit the budget and the free blocks."""
        take = min(len(s.tokens) - s.computed, budget)
        bs = self.runner.block_size
        room = (-(-s.computed // bs) + free) * bs - s.computed  # slots in held + free blocks
        return max(0, min(take, room))

    @staticmethod
    def _add_chunk(s: _Sequence, take: int, items, owners) -> None:
        last = s.computed + take == len(s.tokens)
        items.append((s.seq, s.tokens[s.computed:s.computed + take], "last" if last else "none"))
        owners.append(s)

    def _preempt(self, exclude: Optional[_Sequence] = None) -> bool:
        """Frees the youngest running sequence (younger than `exclude`, when given), to be
        recomputed later. False when there is none."""
        candidates = [s for s in self._running if s is not exclude and s.seq is not None
                      and (exclude is None or s.arrival > exclude.arrival)]
        if not candidates or (exclude is None and len(self._running) <= 1):
            return False
        victim = max(candidates, key=lambda s: s.arrival)
        self.runner.release_sequence(victim.seq)
        victim.seq, victim.computed = None, 0
        self._running.remove(victim)
        self._waiting.insert(0, victim)
        self.num_preemptions += 1
        return True

    def _finish_alone(self) -> List[RequestOutput]:
        """The oldest sequence cannot grow even with every other one preempted: it has filled
        the KV cache by itself and ends as if it reached its length limit."""
        s = min(self._running, key=lambda s: s.arrival)
        tail = s.progress.finish("length")
        self._drop(s)
        req = self._requests.get(s.request_id)
        if req is None:
            return []
        out = req.output()
        out.delta = {s.index: req.delta_text.pop(s.index, "") + tail}
        if out.finished:
            del self._requests[s.request_id]
        return [out]

    def _drop(self, s: _Sequence) -> None:
        if s.seq is not None:
            self.runner.release_sequence(s.seq)
            s.seq = None
        if s in self._running:
            self._running.remove(s)
        if s in self._waiting:
            self._waiting.remove(s)

    def stats(self) -> dict:
        st = dict(self.runner.stats())
        st["running"] = len(self._running)
        st["waiting"] = len(self._waiting)
        st["preemptions"] = self.num_preemptions
        q = st.get("prefix_query_tokens", 0)
        st["prefix_cache_hit_rate"] = st.get("prefix_hit_tokens", 0) / q if q else 0.0
        elapsed = time.perf_counter() - self._started
        st["generated_tokens"] = self._generated
        st["generation_tokens_per_s"] = self._generated / elapsed if elapsed > 0 else 0.0
        return st
