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
from typing import Callable, Dict, List, Optional, Union

import numpy as np

from . import _core
from .outputs import CompletionDelta, RequestDelta, RequestOutput
from .prompt_embeds import PromptEmbeds
from .sampling import Sampler, SamplingParams, SamplingState
from .speculative import DraftModel, NgramIndex, Speculation, SpeculativeConfig
from .structured import GrammarConstraint
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
    prompt_ids: List[int]
    spec: Optional[Speculation] = None  # None: this completion does not speculate


def token_ids_of(ids) -> List[int]:
    """Token ids as a list of ints. TypeError unless they are integers (bools and floats are
    not); their values are checked against the vocabulary once, by the engine, when a request is
    admitted (ids beyond 64 bits, which could not reach it, are refused here)."""
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise TypeError(f"token ids must be a flat array of integers, got {ids.dtype} of shape {ids.shape}")
        return ids.tolist()
    out = []
    for t in ids:
        if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
            raise TypeError(f"token ids must be integers, got {t!r}")
        t = int(t)
        if not -2**63 <= t < 2**63:
            raise ValueError(f"token id {t} is out of range")
        out.append(t)
    return out


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
    prompt_logprobs: Optional[list] = None  # filled as the first completion's prompt is computed

    def output(self) -> RequestOutput:
        outs = [c.progress.to_output() for c in self.completions]
        params = self.completions[0].state.params
        if params.ranks_completions:  # best_of: the n with the highest cumulative logprob
            outs = sorted(outs, key=lambda o: o.cumulative_logprob, reverse=True)[:params.n]
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_ids), outs,
                             finished=all(c.progress.finished for c in self.completions),
                             prompt_logprobs=None if self.prompt_logprobs is None else list(self.prompt_logprobs))

    def note(self, c: _Completion, text: str, token: Optional[int] = None) -> None:
        d = self.deltas.setdefault(c.index, CompletionDelta(c.index, "", []))
        d.text += text
        if token is not None:
            d.token_ids.append(token)
            if c.progress.logprobs is not None:
                d.logprobs = (d.logprobs or []) + c.progress.logprobs[-1:]
        d.finish_reason, d.stop_reason = c.progress.finish_reason, c.progress.stop_reason
        d.length_limit = c.progress.length_limit


class Engine:
    """speculative: proposals to verify each decode step (a SpeculativeConfig); draft_model: the
    draft model's engine when the config names one."""

    def __init__(self, runner, tokenizer: Tokenizer, max_num_seqs: int = 32,
                 max_num_batched_tokens: int = 512, speculative: Optional[SpeculativeConfig] = None,
                 draft_model: Optional[DraftModel] = None):
        for name, v in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        self.runner = runner
        self.tokenizer = tokenizer
        self._kv_blocks = runner.stats()["kv_blocks_total"]  # the pool is sized once
        self._kv_tokens = self._kv_blocks * runner.block_size
        self._max_model_len = runner.max_model_len
        self.core = _core.Engine(runner, max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=max_num_batched_tokens)
        self.sampler = Sampler(decode_token=lambda t: tokenizer.decode([t], skip_special_tokens=False))
        self.speculative = speculative
        self.draft_model = draft_model
        self.spec_proposed = self.spec_accepted = 0  # proposals verified, and accepted
        self._requests: Dict[str, _Request] = {}
        self._by_seq: Dict[int, _Completion] = {}
        self._consumers: Dict[int, RowConsumer] = {}  # rows of scores, embeddings and prompts
        self._scores: set = set()  # score and embedding sequences still running
        self._ids = itertools.count()

    # ---- requests ----
    def add_request(self, prompt_ids: Union[List[int], PromptEmbeds], params: SamplingParams,
                    prompt: Optional[str] = None, request_id: Optional[str] = None, lora=None) -> str:
        """Queues a request (its ``params.best_of`` completions); ValueError when it could never
        run. A prompt of embeddings has no prompt ids: penalties and prompt lookup see the
        generated tokens only. lora: (the runner's LoraAdapter its completions run with, the
        request's scale of it)."""
        if not isinstance(params, SamplingParams):
            raise TypeError("sampling params must be a ferrum.SamplingParams")
        embeds = prompt_ids if isinstance(prompt_ids, PromptEmbeds) else None
        if embeds is not None:
            if params.prompt_logprobs is not None:
                raise ValueError("prompt_logprobs needs a prompt of token ids, not prompt_embeds")
            if self.draft_model is not None and params.speculative_decoding:
                raise ValueError("a draft model cannot read prompt_embeds: turn speculative decoding off for "
                                 "this request (SamplingParams(speculative_decoding=False))")
        prompt_ids = [] if embeds is not None else token_ids_of(prompt_ids)
        vocab = self.runner.config["vocab_size"]
        biased = max(params.logit_bias or (), default=-1)
        if biased >= vocab:
            raise ValueError(f"logit_bias token id {biased} is out of range [0, {vocab})")
        self.check_fits(len(embeds) if embeds is not None else len(prompt_ids), params.max_tokens)
        if params.best_of > self._kv_blocks:  # also keeps an absurd n from building that many completions
            raise ValueError(f"{params.best_of} completions (n / best_of) is more than the KV cache's "
                             f"{self._kv_blocks} blocks: each completion needs one of its own")
        lora, lora_scale = lora or (None, 1.0)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        req = _Request(request_id, prompt, prompt_ids, [])
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * len(prompt_ids)
        try:
            for i in range(params.best_of):
                # The first completion returns its prompt's rows: each predicts the next prompt token.
                if embeds is not None:
                    seq = self.core.add_prompt_embeds(embeds.rows, "generate", lora=lora, lora_scale=lora_scale)
                else:
                    seq = self.core.add_sequence(prompt_ids, 0 if i == 0 and req.prompt_logprobs is not None else -1,
                                                 lora=lora, lora_scale=lora_scale)
                progress = RequestProgress(params, self.tokenizer.eos_token_ids, index=i)
                state = SamplingState(params, prompt_ids, index=i, output_token_ids=progress.token_ids)
                if params.structured_outputs is not None:
                    state.constraint = GrammarConstraint(params.structured_outputs, self.tokenizer, vocab)
                spec = self._new_speculation() if self.speculative and params.speculative_decoding else None
                req.completions.append(_Completion(
                    request_id, i, seq, state, progress,
                    IncrementalDecoder(self.tokenizer, params.skip_special_tokens), prompt_ids, spec))
        except BaseException:
            for c in req.completions:
                self.core.abort(c.seq)
            raise
        for c in req.completions:
            self._by_seq[c.seq] = c
        if req.prompt_logprobs is not None:
            self._consumers[req.completions[0].seq] = self._prompt_logprobs_consumer(req, params.prompt_logprobs)
        self._requests[request_id] = req
        return request_id

    def check_fits(self, prompt_tokens: int, max_tokens: Optional[int]) -> None:
        """ValueError when max_tokens can never be generated after this prompt, alone in the
        engine: the sequence would outgrow max_model_len, or the KV cache (which holds the prompt
        and every generated token but the last). A prompt that fits no token at all is left to
        the engine's own refusal."""
        if max_tokens is None:
            return
        by_length = self._max_model_len - prompt_tokens
        by_cache = self._kv_tokens - prompt_tokens + 1
        most = min(by_length, by_cache)
        if most < 1 or max_tokens <= most:
            return
        limit = (f"max_model_len is {self._max_model_len}" if by_length <= by_cache
                 else f"the KV cache holds {self._kv_tokens} tokens")
        raise ValueError(f"max_tokens={max_tokens} cannot fit after a prompt of {prompt_tokens} tokens: {limit}, "
                         f"so at most {most} tokens can be generated")

    def _prompt_logprobs_consumer(self, req: _Request, top: int) -> RowConsumer:
        def consume(positions: np.ndarray, logits: np.ndarray) -> None:
            following = [req.prompt_ids[p + 1] for p in positions]
            for p, entry in zip(positions, self.sampler.prompt_logprobs(logits, following, top)):
                req.prompt_logprobs[p + 1] = entry
        return consume

    def abort(self, request_id: str) -> Optional[RequestDelta]:
        """Ends a request wherever it is (waiting, mid-prompt, decoding) and frees its blocks.
        Returns its final delta (finish_reason "abort"), or None for an unknown or finished id."""
        req = self._requests.get(str(request_id))
        if req is None:
            return None
        for c in req.completions:
            self.core.abort(c.seq)
            self._by_seq.pop(c.seq, None)
            self._release(c)
            if not c.progress.finished:
                req.note(c, c.progress.finish("abort"))
        return self._delta(req)

    def add_score(self, token_ids: Union[List[int], PromptEmbeds], rows_from: int, consume: RowConsumer,
                  embed: bool = False, lora=None) -> int:
        """Queues a score of `token_ids`: the logits at positions ``rows_from ..`` (each
        predicting the next token), or with `embed` the final hidden states there, go to
        ``consume`` as steps compute them, with f32 activations. Returns its sequence;
        ``score_finished(seq)`` tells when it is done. ValueError when it could never run. lora:
        as add_request's."""
        lora, lora_scale = lora or (None, 1.0)
        if isinstance(token_ids, PromptEmbeds):
            seq = self.core.add_prompt_embeds(token_ids.rows, "embed" if embed else "score", rows_from, lora=lora,
                                              lora_scale=lora_scale)
        else:
            seq = self.core.add_score(token_ids, rows_from, embed, lora=lora, lora_scale=lora_scale)
        self._consumers[seq] = consume
        self._scores.add(seq)
        return seq

    def score_finished(self, seq: int) -> bool:
        return seq not in self._scores

    def abort_score(self, seq: int) -> None:
        self.core.abort(seq)
        self._consumers.pop(seq, None)
        self._scores.discard(seq)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    # ---- one step ----
    def step(self) -> List[RequestDelta]:
        """Runs one forward; hands score rows to their consumers and returns what each
        generation request that changed produced in it."""
        out = self.core.step()
        touched: Dict[str, _Request] = {}
        for seq in out["ended"]:  # the KV pool is full and this one alone holds it
            self._end(seq, "kv_cache", touched)
        self._hand_out_rows(out)
        # (a row whose request another thread aborted meanwhile is dropped)
        rows = [int(i) for i in out["sample_rows"] if int(out["seqs"][i]) in self._by_seq]
        if rows:
            self._advance_completions(out, rows, touched)
        return [self._delta(req) for req in touched.values()]

    def _advance_completions(self, out: dict, rows: List[int], touched: Dict[str, _Request]) -> None:
        """Samples (and verifies proposals) for the completions whose rows these are, emits what
        they produce, proposes their next tokens and hands it all back to the engine."""
        seqs = out["seqs"]
        entries = []  # (completion, its sample row, proposals verified after it)
        for i in rows:
            c = self._by_seq[int(seqs[i])]
            verified = 0
            if c.spec is not None:
                while i + 1 + verified < len(seqs) and seqs[i + 1 + verified] == c.seq:
                    verified += 1
            entries.append((c, i, verified))
        self.spec_proposed += sum(v for _, _, v in entries)
        results = self._sample_and_emit(out["logits"], entries, touched)
        committed, tokens, finished, accepted, going_on = [], [], [], [], []
        for (c, _, verified), (token, taken, done) in zip(entries, results):
            committed.append(c.seq)
            tokens.append(token)
            finished.append(done)
            accepted.append(taken)
            if done:
                del self._by_seq[c.seq]
                self._release(c)
            elif c.spec is not None:
                c.spec.adapt(verified, taken, self.speculative.num_speculative_tokens)
                going_on.append(c)
        if self.speculative is None:
            ended = self.core.commit(committed, tokens, finished)
        else:
            self._propose(going_on)
            drafts = [c.spec.draft if c.spec is not None else [] for c, _, _ in entries]
            ended = self.core.commit(committed, tokens, finished, accepted, drafts)
        for seq in ended:  # reached max_model_len
            self._end(seq, "max_model_len", touched)

    def _sample_and_emit(self, logits: np.ndarray, entries, touched: Dict[str, _Request]) -> List[tuple]:
        """Decides each entry's tokens row by row (its sample row, then one per verified proposal
        while they are accepted), emitting each as it is decided (penalties see the history so
        far). Returns per entry (its last token, proposals accepted before it, finished)."""
        results: List[Optional[tuple]] = [None] * len(entries)
        greedy_tokens = None  # plain greedy verification: every row's argmax at once
        if any(v for _, _, v in entries) and all(c.state.params.plain_greedy for c, _, _ in entries):
            needed = np.concatenate([np.arange(i, i + v + 1) for _, i, v in entries])
            greedy_tokens = np.zeros(len(logits), dtype=np.int64)
            greedy_tokens[needed] = np.argmax(logits[needed], axis=1)
        active, j = list(range(len(entries))), 0
        while active:
            rows = np.array([entries[e][1] + j for e in active])
            states = [entries[e][0].state for e in active]
            proposals = [entries[e][0].spec.draft[j] if j < entries[e][2] else None for e in active]
            if greedy_tokens is not None:
                tokens, logprobs = greedy_tokens[rows], [None] * len(active)
                taken = [x is not None and int(t) == x for t, x in zip(tokens, proposals)]
            elif all(x is None for x in proposals):
                every_row = len(rows) == len(logits) and rows[-1] == len(logits) - 1  # rows ascend
                rows_logits = logits if every_row else logits[rows]
                result = self.sampler.sample(rows_logits, states)
                tokens, logprobs, taken = result.token_ids, result.logprobs, [False] * len(active)
            else:
                drafts = [self._draft_distribution(entries[e][0], j) for e in active]
                tokens, taken, logprobs = self.sampler.verify(logits[rows], states, proposals, drafts)
            still = []
            for e, token, ok, lp in zip(active, tokens, taken, logprobs):
                c = entries[e][0]
                token = int(token)
                emit, done, _ = c.progress.append(token, c.decoder.push(token), lp)
                req = self._requests[c.request_id]
                req.note(c, emit, token)
                touched[req.request_id] = req
                self.spec_accepted += bool(ok)
                if ok and not done:
                    still.append(e)
                else:
                    results[e] = (token, j, done)
            active, j = still, j + 1
        return results

    @staticmethod
    def _draft_distribution(c: _Completion, j: int) -> Optional[np.ndarray]:
        q = c.spec.q
        return None if q is None or j >= len(q) else q[j]

    def _new_speculation(self) -> Speculation:
        spec = self.speculative
        lookup = NgramIndex(spec.prompt_lookup_min, spec.prompt_lookup_max) if spec.method == "ngram" else None
        return Speculation(spec.num_speculative_tokens, lookup=lookup)

    def _propose(self, completions: List[_Completion]) -> None:
        """Each completion's proposals for the next step (its tokens so far just decided)."""
        spec = self.speculative
        wants = []
        for c in completions:
            params = c.state.params
            k = c.spec.k
            if params.max_tokens is not None:  # no more than the request still takes
                k = min(k, params.max_tokens - len(c.progress.token_ids))
            c.spec.draft, c.spec.q = [], None
            if k > 0:
                wants.append((c, k))
        if spec.method == "ngram":
            for c, k in wants:
                c.spec.lookup.follow(c.prompt_ids, c.progress.token_ids)
                c.spec.draft = c.spec.lookup.propose(k)
        elif wants:
            proposals = self.draft_model.propose(
                [(c.seq, c.prompt_ids + c.progress.token_ids, k) for c, k in wants], self._sample_draft)
            for c, _ in wants:
                draft, qs = proposals.get(c.seq, ([], []))
                c.spec.draft = draft
                c.spec.q = None if all(q is None for q in qs) else qs

    def _sample_draft(self, target_seqs: List[int], logits: np.ndarray):
        """Draws proposals from the draft model's rows as each completion samples (greedy ones
        take the argmax; the others keep the distribution each proposal was drawn from)."""
        states = [self._by_seq[s].state for s in target_seqs]
        if all(st.params.greedy for st in states):
            return np.argmax(logits, axis=1), [None] * len(states)
        dists = self.sampler.distribution(logits, states)
        return self.sampler.draw(dists, states), [None if st.params.greedy else d for st, d in zip(states, dists)]

    def _release(self, c: _Completion) -> None:
        """What a completion holds beside its sequence: its draft's sequence, its rows' consumer."""
        self._consumers.pop(c.seq, None)
        if self.draft_model is not None:
            self.draft_model.release(c.seq)

    def _hand_out_rows(self, out: dict) -> None:
        """Hands each score or embedding its rows of this step (one contiguous run each: logits
        rows first, then hidden-state rows)."""
        if not self._consumers:
            return
        seqs, logit_rows = out["seqs"], len(out["logits"])
        sampled = set(out["sample_rows"].tolist())
        i = 0
        while i < len(seqs):
            j = i + 1
            while j < len(seqs) and seqs[j] == seqs[i] and j not in sampled:
                j += 1
            consume = self._consumers.get(int(seqs[i]))
            if consume is not None and i not in sampled:  # a generation's prompt rows come before its sample row
                rows = out["logits"][i:j] if i < logit_rows else out["hidden"][i - logit_rows:j - logit_rows]
                consume(out["positions"][i:j], rows)
            while j < len(seqs) and seqs[j] == seqs[i]:  # the sample row and any proposals' rows
                j += 1
            i = j
        for seq in out["scored"]:
            self._consumers.pop(seq, None)
            self._scores.discard(seq)

    def _end(self, seq: int, length_limit: str, touched: Dict[str, _Request]) -> None:
        """The engine ended a sequence at a limit other than max_tokens."""
        if seq in self._scores:  # a score fits the pool whole by admission: never ended
            raise RuntimeError(f"the engine ended score sequence {seq}")
        c = self._by_seq.pop(seq)
        self._release(c)
        req = self._requests[c.request_id]
        req.note(c, c.progress.finish("length", length_limit))
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
        st["spec_proposed_tokens"], st["spec_accepted_tokens"] = self.spec_proposed, self.spec_accepted
        st["spec_acceptance_rate"] = self.spec_accepted / self.spec_proposed if self.spec_proposed else 0.0
        return st
