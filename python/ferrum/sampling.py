"""Sampling parameters and a batched, numpy-vectorised token sampler.

Semantics follow vLLM (v1) unless noted:

* Processing order per row: logits_processors -> structured-output mask -> logit_bias ->
  repetition penalty -> presence / frequency penalties -> (greedy rows: argmax here) ->
  temperature -> top-k -> top-p -> min-p -> draw from the renormalised distribution.
  (vLLM v1 runs min-p before top-k/top-p; we apply it last, on the
  renormalised top-k/top-p distribution.)
* A temperature below ``GREEDY_TEMPERATURE`` (1e-5, vLLM's epsilon) is greedy:
  argmax of the penalised logits, first maximum on ties.
* top-k keeps every token whose logit is >= the k-th largest (ties at the
  boundary are kept, as vLLM does).  top-p keeps the smallest prefix of the
  sorted distribution whose mass reaches p (the top token is always kept).
  min-p drops tokens with probability < min_p * max probability.
* Logprobs are computed from the log-softmax of the *raw* logits, before
  bias, penalties, temperature and filtering (vLLM's default
  ``logprobs_mode="raw_logprobs"``); each ``Logprob.decoded_token`` is its token
  decoded alone, as vLLM does.
* ``best_of`` > ``n``: ``best_of`` completions are sampled and the ``n`` with the
  highest cumulative logprob are returned (vLLM's ``best_of``).

Each request owns a ``SamplingState`` with its own ``np.random.Generator``;
a row's draw uses only that generator (one uniform per step, inverse CDF), so
a seeded request yields the same tokens whatever else shares the batch.

Pure numpy: importable without the compiled ``ferrum._core``.
"""
from __future__ import annotations

import inspect
import math
import numbers
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from .outputs import Logprob, StepLogprobs
from .structured import GrammarConstraint, StructuredOutputsParams

GREEDY_TEMPERATURE = 1e-5


def _is_int(value) -> bool:
    # bool is an int subclass; True as a token id or count is almost surely a bug.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass
class SamplingParams:
    """Per-request sampling and stopping parameters (vLLM-shaped).

    ``top_k`` 0 or -1 disables top-k (normalised to 0).  ``max_tokens=None``
    means "until the context is full".  ``stop`` is normalised to a list.
    """

    n: int = 1
    max_tokens: Optional[int] = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[Dict[int, float]] = None
    seed: Optional[int] = None
    stop: Union[None, str, List[str]] = None
    stop_token_ids: Optional[List[int]] = None
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    skip_special_tokens: bool = True
    # Callables f(output_token_ids, logits) -> logits (or f(prompt_token_ids, output_token_ids,
    # logits)), applied in order to each step's raw logits row (float64, length vocab) before
    # logit_bias and the penalties, as vLLM's logits_processors.
    logits_processors: Optional[List[Callable]] = None
    # Completions to sample, of which the n with the highest cumulative logprob are returned
    # (None: n). Needs sampling: greedy completions would all be the same.
    best_of: Optional[int] = None
    # With an LLM configured for speculative decoding: False decodes this request plainly.
    speculative_decoding: bool = True
    # Output constrained to a JSON schema, regex, choice or grammar (ferrum.structured, llguidance).
    structured_outputs: Optional[StructuredOutputsParams] = None

    def __post_init__(self) -> None:
        def fail(message: str):
            raise ValueError(f"SamplingParams: {message}")

        if not _is_int(self.n) or self.n < 1:
            fail(f"n must be an integer >= 1, got {self.n!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            fail(f"max_tokens must be None or an integer >= 1, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            fail(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            fail(f"top_k must be an integer >= -1 (0 or -1 disables it), got {self.top_k!r}")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            fail(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            fail(f"min_p must be in [0, 1], got {self.min_p!r}")
        if (not _is_real(self.repetition_penalty) or not math.isfinite(self.repetition_penalty)
                or self.repetition_penalty <= 0):
            fail(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2.0 <= value <= 2.0:
                fail(f"{name} must be in [-2, 2], got {value!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                fail(f"{name} must be None or an integer >= 0, got {value!r}")
        if self.seed is not None and not _is_int(self.seed):
            fail(f"seed must be None or an integer, got {self.seed!r}")
        if self.logits_processors is not None:
            if not isinstance(self.logits_processors, (list, tuple)) or not all(
                    callable(f) for f in self.logits_processors):
                fail("logits_processors must be a list of callables")
            self.logits_processors = list(self.logits_processors)
        if self.best_of is None:
            self.best_of = self.n
        elif not _is_int(self.best_of) or self.best_of < self.n:
            fail(f"best_of must be None or an integer >= n ({self.n}), got {self.best_of!r}")
        elif self.best_of > self.n and self.greedy:
            fail(f"best_of ({self.best_of}) > n ({self.n}) needs temperature > 0: greedy completions are all the same")
        for name in ("ignore_eos", "skip_special_tokens", "speculative_decoding"):
            value = getattr(self, name)
            if not isinstance(value, (bool, np.bool_)):
                fail(f"{name} must be True or False, got {value!r}")
            setattr(self, name, bool(value))
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            fail("structured_outputs must be a ferrum.structured.StructuredOutputsParams")

        self.stop = self._normalise_stop(self.stop, fail)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif (isinstance(self.stop_token_ids, (str, bytes))
              or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids)):
            fail(f"stop_token_ids must be a list of non-negative ints, got {self.stop_token_ids!r}")
        else:
            self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                fail(f"logit_bias must be a dict {{token_id: bias}}, got {type(self.logit_bias).__name__}")
            for token, bias in self.logit_bias.items():
                if not _is_int(token) or token < 0:
                    fail(f"logit_bias keys must be non-negative int token ids, got {token!r}")
                if not _is_real(bias) or not math.isfinite(bias):
                    fail(f"logit_bias values must be finite numbers, got {bias!r} for token {token}")
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
        if self.top_k == -1:
            self.top_k = 0

    @staticmethod
    def _normalise_stop(stop, fail) -> List[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
            fail(f"stop must be a string or a list of strings, got {stop!r}")
        if any(s == "" for s in stop):
            fail("stop strings must be non-empty")
        return list(stop)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def ranks_completions(self) -> bool:
        """Whether only the best ``n`` of ``best_of`` completions are returned (ranked by their
        cumulative logprob, which every completion then tracks)."""
        return self.best_of > self.n

    @property
    def plain_greedy(self) -> bool:
        """Greedy on the raw logits: no logits processor, no logprobs to report."""
        return self.structured_outputs is None and self._greedy_on_raw_logits

    @property
    def masked_greedy(self) -> bool:
        """Greedy on the raw logits but for the structured-output mask."""
        return self.structured_outputs is not None and self._greedy_on_raw_logits

    @property
    def _greedy_on_raw_logits(self) -> bool:
        return (self.greedy and not self.logit_bias and not self.logits_processors
                and self.repetition_penalty == 1.0 and self.presence_penalty == 0.0
                and self.frequency_penalty == 0.0 and self.logprobs is None)


def make_generator(seed: Optional[int], index: int = 0) -> np.random.Generator:
    """A request's own generator: from ``seed`` (and the completion index, so the
    ``n`` completions of a seeded request differ), else from fresh OS entropy."""
    if seed is None:
        return np.random.default_rng()
    # Two's complement keeps negative seeds valid and distinct for SeedSequence.
    entropy = int(seed) & 0xFFFF_FFFF_FFFF_FFFF
    return np.random.default_rng(np.random.SeedSequence(entropy, spawn_key=(index,)))


@dataclass
class SamplingState:
    """One running sequence as the sampler sees it: params, generator, history.

    ``index`` is which of the request's ``n`` completions this is.  Call
    ``append`` with each token the sampler picked for this sequence.
    ``constraint`` masks what ``params.structured_outputs`` forbids (one per completion).
    """

    params: SamplingParams
    prompt_token_ids: Sequence[int] = ()
    index: int = 0
    generator: Optional[np.random.Generator] = None
    output_token_ids: List[int] = field(default_factory=list)
    constraint: Optional[GrammarConstraint] = None

    def __post_init__(self) -> None:
        self.prompt_token_ids = np.asarray(self.prompt_token_ids, dtype=np.int64).reshape(-1)
        if self.generator is None:
            self.generator = make_generator(self.params.seed, self.index)

    def append(self, token_id: int) -> None:
        self.output_token_ids.append(int(token_id))


@dataclass
class TokenLogprobs:
    """Logprob information for one row of one step (from the raw logits).

    ``top`` holds the ``k`` most likely tokens, most likely first.
    """

    token_id: int
    logprob: float
    rank: int
    top: StepLogprobs
    decoded_token: Optional[str] = None

    def as_step_logprobs(self) -> StepLogprobs:
        """vLLM's per-step dict: the top-k plus the sampled token."""
        merged = dict(self.top)
        merged.setdefault(self.token_id, Logprob(self.logprob, self.rank, self.decoded_token))
        return merged


@dataclass
class SampleResult:
    token_ids: np.ndarray  # [B] int64
    logprobs: List[Optional[TokenLogprobs]]  # None for rows that did not ask


def _softmax(x: np.ndarray) -> np.ndarray:
    # Rows always keep at least one finite entry, so the max is finite.
    shifted = np.exp(x - x.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


# Top-k / top-p only look at the most likely tokens.  Sorting a whole 128k
# vocabulary per row costs ~10 ms, so each row is first cut (argpartition,
# linear time) to a pool of its most likely tokens and only the pool is
# sorted; a top-p row whose pool holds less than p of the mass is redone
# with a 16x larger pool, up to the full vocabulary.
TOP_P_POOL = 1024


def _mask_top_k_top_p(logits: np.ndarray, top_k: np.ndarray, top_p: np.ndarray,
                      pool_size: int = TOP_P_POOL) -> np.ndarray:
    """Set to -inf what top-k (0 = off) then top-p (1 = off) drop, per row."""
    rows, vocab = logits.shape
    pool = min(vocab, max(pool_size, int(top_k.max())))
    if pool < vocab:
        pool_ids = np.argpartition(-logits, pool - 1, axis=1)[:, :pool]
    else:
        pool_ids = np.broadcast_to(np.arange(vocab), (rows, vocab))
    pool_logits = np.take_along_axis(logits, pool_ids, axis=1)
    by_rank = np.argsort(-pool_logits, axis=1)
    pool_ids = np.take_along_axis(pool_ids, by_rank, axis=1)
    pool_logits = np.take_along_axis(pool_logits, by_rank, axis=1)

    # top-k: keep every logit >= the k-th largest, so boundary ties survive.
    kth_largest = np.where(top_k > 0, pool_logits[np.arange(rows), np.maximum(top_k, 1) - 1], -np.inf)
    logits = np.where(logits >= kth_largest[:, None], logits, -np.inf)
    pool_logits = np.where(pool_logits >= kth_largest[:, None], pool_logits, -np.inf)

    use_top_p = top_p < 1.0
    if not use_top_p.any():
        return logits
    # top-p on the top-k-renormalised distribution (full-row normaliser).
    row_max = logits.max(axis=1, keepdims=True)
    normaliser = row_max + np.log(np.exp(logits - row_max).sum(axis=1, keepdims=True))
    pool_probs = np.exp(pool_logits - normaliser)
    mass_before = np.cumsum(pool_probs, axis=1) - pool_probs
    # Keep a token while the more likely ones hold less than p; the top token
    # (mass_before == 0) always stays.  Tokens outside the pool come after at
    # least the pool's whole mass, so they go whenever the pool reaches p.
    keep = np.zeros((rows, vocab), dtype=bool)
    np.put_along_axis(keep, pool_ids, mass_before < top_p[:, None], axis=1)
    pool_reaches_p = (pool == vocab) | (pool_probs.sum(axis=1) >= top_p)
    done = use_top_p & pool_reaches_p
    logits[done] = np.where(keep[done], logits[done], -np.inf)
    retry = use_top_p & ~pool_reaches_p
    if retry.any():
        # Widen the pool 16x (then to the whole vocabulary) for flat rows.
        logits[retry] = _mask_top_k_top_p(logits[retry], np.zeros(int(retry.sum()), np.int64),
                                          top_p[retry], pool_size=pool * 16)
    return logits


class Sampler:
    """Picks one token per row of a ``[B, V]`` logits batch. ``decode_token(id) -> str`` fills
    ``Logprob.decoded_token`` (left None without it)."""

    def __init__(self, decode_token: Optional[Callable[[int], str]] = None):
        self.decode_token = decode_token

    def sample(self, logits: np.ndarray, requests: Sequence[SamplingState]) -> SampleResult:
        logits = np.asarray(logits)
        if all(state.params.plain_greedy for state in requests):
            # The argmax of the f32 logits is the argmax of their float64 copy (the conversion is
            # exact and monotonic; first maximum on ties either way), without copying [B, V]
            # floats every step: ~3 ms a step at 16 sequences of a 49k vocabulary.
            self._check_shape(logits, requests)
            return SampleResult(np.argmax(logits, axis=1).astype(np.int64), [None] * len(requests))
        if all(state.params.plain_greedy or state.params.masked_greedy for state in requests):
            # A grammar's greedy row: its own argmax whenever the grammar allows it.
            self._check_shape(logits, requests)
            tokens = np.argmax(logits, axis=1).astype(np.int64)
            for row, state in enumerate(requests):
                if state.constraint is not None:
                    tokens[row] = state.constraint.greedy(logits[row], int(tokens[row]), state.output_token_ids)
            return SampleResult(tokens, [None] * len(requests))
        work = self.process_logits(logits, requests)  # also checks the shape
        batch = logits.shape[0]
        params = [state.params for state in requests]

        temperature = np.array([p.temperature for p in params], dtype=np.float64)
        greedy = temperature < GREEDY_TEMPERATURE
        token_ids = np.empty(batch, dtype=np.int64)
        token_ids[greedy] = np.argmax(work[greedy], axis=1)  # first maximum on ties

        random_rows = np.flatnonzero(~greedy)
        if random_rows.size:
            probs = self._filtered_probs(work[random_rows] / temperature[random_rows, None],
                                         [params[i] for i in random_rows])
            uniforms = np.array([requests[i].generator.random() for i in random_rows])
            token_ids[random_rows] = self._inverse_cdf(probs, uniforms)

        return SampleResult(token_ids, self._gather_logprobs(logits, token_ids, params))

    def distribution(self, logits: np.ndarray, requests: Sequence[SamplingState]) -> np.ndarray:
        """float64 [B, V]: what ``sample`` draws each row from (greedy rows: all on the argmax)."""
        work = self.process_logits(logits, requests)
        params = [state.params for state in requests]
        probs = np.zeros_like(work)
        greedy = np.array([p.greedy for p in params], dtype=bool)
        probs[np.flatnonzero(greedy), np.argmax(work[greedy], axis=1)] = 1.0
        random_rows = np.flatnonzero(~greedy)
        if random_rows.size:
            temperature = np.array([params[i].temperature for i in random_rows])[:, None]
            probs[random_rows] = self._filtered_probs(work[random_rows] / temperature,
                                                      [params[i] for i in random_rows])
        return probs

    def draw(self, probs: np.ndarray, requests: Sequence[SamplingState]) -> np.ndarray:
        """One token per row of ``distribution``'s output, with each request's generator."""
        uniforms = np.array([state.generator.random() for state in requests])
        return self._inverse_cdf(probs, uniforms)

    def verify(self, logits: np.ndarray, requests: Sequence[SamplingState], proposals: Sequence[Optional[int]],
               drafts: Sequence[Optional[np.ndarray]]) -> Tuple[np.ndarray, np.ndarray, List[Optional[TokenLogprobs]]]:
        """Speculative decoding: per row, the token the request produces there when `proposals`
        (None: no proposal) may be taken. A greedy row takes a proposal equal to its argmax; a
        random row takes x with probability min(1, p(x) / q(x)), q being the distribution x was
        drawn from (`drafts`; None: x was proposed surely, as prompt lookup does), and on
        rejection draws from norm(max(0, p - q)): the token follows p either way. Returns the
        tokens, whether each is the proposal, and their logprobs (as ``sample``'s)."""
        logits = np.asarray(logits)
        probs = self.distribution(logits, requests)
        params = [state.params for state in requests]
        tokens = np.argmax(probs, axis=1)
        for row, (state, x, q) in enumerate(zip(requests, proposals, drafts)):
            p = probs[row]
            if state.params.greedy:
                continue  # the argmax: the proposal exactly when it equals it
            if x is None:
                tokens[row] = self._inverse_cdf(p[None], np.array([state.generator.random()]))[0]
            elif state.generator.random() < min(1.0, p[x] / (1.0 if q is None else max(q[x], 1e-300))):
                tokens[row] = x
            else:
                residual = p.copy()
                if q is None:
                    residual[x] = 0.0
                else:
                    residual = np.maximum(residual - q, 0.0)
                if not residual.sum() > 0:  # p == q to rounding: nothing left but p itself
                    residual = p
                tokens[row] = self._inverse_cdf(residual[None], np.array([state.generator.random()]))[0]
        accepted = np.array([x is not None and int(t) == x for t, x in zip(tokens, proposals)], dtype=bool)
        return tokens.astype(np.int64), accepted, self._gather_logprobs(logits, tokens, params)

    def process_logits(self, logits: np.ndarray, requests: Sequence[SamplingState]) -> np.ndarray:
        """Logits processors, the structured-output mask, logit_bias, then repetition, then
        presence/frequency penalties.

        Returns a float64 copy (the caller's array is untouched): double
        precision keeps the top-p tail masses and inverse-CDF sums accurate.
        Greedy rows take the argmax of this.
        """
        logits = np.asarray(logits)
        self._check_shape(logits, requests)
        work = logits.astype(np.float64, copy=True)
        self._apply_logits_processors(work, requests)
        for row, state in enumerate(requests):
            if state.constraint is not None:
                state.constraint.apply(work[row], state.output_token_ids)
        self._apply_logit_bias(work, [state.params for state in requests])
        self._apply_penalties(work, requests)
        return work

    @staticmethod
    def _check_shape(logits: np.ndarray, requests: Sequence[SamplingState]) -> None:
        if logits.ndim != 2 or logits.shape[0] != len(requests):
            raise ValueError(f"logits must be [B, V] with B == len(requests) ({len(requests)}), "
                             f"got shape {logits.shape}")

    # -- logits processors (all edit ``work`` in place) --------------------

    @staticmethod
    def _apply_logits_processors(work: np.ndarray, requests: Sequence[SamplingState]) -> None:
        for row, state in enumerate(requests):
            for f in state.params.logits_processors or ():
                try:  # (prompt_token_ids, output_token_ids, logits) when it takes three
                    n_args = len(inspect.signature(f).parameters)
                except (TypeError, ValueError):
                    n_args = 2
                args = ((list(state.prompt_token_ids),) if n_args == 3 else ()) + (list(state.output_token_ids),)
                out = np.asarray(f(*args, work[row]), dtype=np.float64)
                if out.shape != work[row].shape:
                    raise ValueError(f"a logits processor returned shape {out.shape}, not {work[row].shape}")
                work[row] = out

    @staticmethod
    def _apply_logit_bias(work: np.ndarray, params: Sequence[SamplingParams]) -> None:
        rows, tokens, biases = [], [], []
        for row, p in enumerate(params):
            if p.logit_bias:
                rows.extend([row] * len(p.logit_bias))
                tokens.extend(p.logit_bias.keys())
                biases.extend(p.logit_bias.values())
        if not rows:
            return
        tokens = np.asarray(tokens, dtype=np.int64)
        if tokens.max() >= work.shape[1]:
            raise ValueError(f"logit_bias token id {int(tokens.max())} >= vocab size {work.shape[1]}")
        np.add.at(work, (np.asarray(rows), tokens), np.asarray(biases))

    @staticmethod
    def _token_counts(histories: List[np.ndarray], vocab: int) -> np.ndarray:
        """[len(histories), vocab] occurrence counts, by one flat bincount."""
        lengths = [len(h) for h in histories]
        ids = np.concatenate(histories) if histories else np.empty(0, np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab):
            raise ValueError(f"token id out of range [0, {vocab}) in a request's history")
        row_offsets = np.repeat(np.arange(len(histories)) * vocab, lengths)
        flat = np.bincount(row_offsets + ids, minlength=len(histories) * vocab)
        return flat.reshape(len(histories), vocab)

    def _apply_penalties(self, work: np.ndarray, requests: Sequence[SamplingState]) -> None:
        vocab = work.shape[1]
        outputs = {}

        def output_ids(row):
            if row not in outputs:
                outputs[row] = np.asarray(requests[row].output_token_ids, dtype=np.int64)
            return outputs[row]

        # Repetition penalty (HF/vLLM): over prompt + output tokens, shrink a
        # positive logit by dividing and push a negative one down by multiplying.
        rep_rows = [r for r, s in enumerate(requests) if s.params.repetition_penalty != 1.0]
        if rep_rows:
            seen = self._token_counts(
                [np.concatenate([requests[r].prompt_token_ids, output_ids(r)]) for r in rep_rows],
                vocab) > 0
            penalty = np.array([requests[r].params.repetition_penalty for r in rep_rows])[:, None]
            block = work[rep_rows]
            penalised = np.where(block > 0, block / penalty, block * penalty)
            work[rep_rows] = np.where(seen, penalised, block)

        # Presence / frequency (OpenAI): on generated tokens only,
        # logit -= frequency * count + presence * [count > 0].
        pf_rows = [r for r, s in enumerate(requests)
                   if s.params.presence_penalty != 0.0 or s.params.frequency_penalty != 0.0]
        if pf_rows:
            counts = self._token_counts([output_ids(r) for r in pf_rows], vocab)
            frequency = np.array([requests[r].params.frequency_penalty for r in pf_rows])[:, None]
            presence = np.array([requests[r].params.presence_penalty for r in pf_rows])[:, None]
            work[pf_rows] -= frequency * counts + presence * (counts > 0)

    # -- filtering and drawing ---------------------------------------------

    @staticmethod
    def _filtered_probs(scaled: np.ndarray, params: Sequence[SamplingParams]) -> np.ndarray:
        """Temperature-scaled logits -> top-k/top-p/min-p filtered, renormalised probs."""
        vocab = scaled.shape[1]
        top_k = np.array([0 if p.top_k >= vocab else p.top_k for p in params], dtype=np.int64)  # k >= V keeps all
        top_p = np.array([p.top_p for p in params], dtype=np.float64)
        min_p = np.array([p.min_p for p in params], dtype=np.float64)

        filtered = np.flatnonzero((top_k > 0) | (top_p < 1.0))
        if filtered.size:
            scaled[filtered] = _mask_top_k_top_p(scaled[filtered], top_k[filtered], top_p[filtered])

        probs = _softmax(scaled)
        if (min_p > 0).any():
            threshold = min_p[:, None] * probs.max(axis=1, keepdims=True)
            probs = np.where(probs < threshold, 0.0, probs)
            probs /= probs.sum(axis=1, keepdims=True)
        return probs

    @staticmethod
    def _inverse_cdf(probs: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
        """Per row, the first token whose CDF exceeds u * total mass."""
        cdf = np.cumsum(probs, axis=1)
        target = uniforms * cdf[:, -1]
        # Strict ">" so a zero-probability token (flat CDF step) is never chosen.
        chosen = (cdf <= target[:, None]).sum(axis=1)
        # Rounding can make u * total == total; then take the row's last
        # token that has probability (rare, so only those rows are searched).
        overshoot = np.flatnonzero(chosen >= probs.shape[1])
        if overshoot.size:
            tail = probs[overshoot, ::-1] > 0
            chosen[overshoot] = probs.shape[1] - 1 - np.argmax(tail, axis=1)
        return chosen

    # -- logprobs ------------------------------------------------------------

    def prompt_logprobs(self, logits: np.ndarray, next_ids: Sequence[int], top: int) -> List[StepLogprobs]:
        """Per row of raw logits: the log-probability of the token that came next, and the `top`
        most likely ones (vLLM's prompt_logprobs entries)."""
        params = [SamplingParams(logprobs=top)] * len(next_ids)
        picked = self._gather_logprobs(np.asarray(logits), np.asarray(next_ids, dtype=np.int64), params)
        return [lp.as_step_logprobs() for lp in picked]

    def _gather_logprobs(self, raw_logits: np.ndarray, token_ids: np.ndarray,
                         params: Sequence[SamplingParams]) -> List[Optional[TokenLogprobs]]:
        """The chosen token's logprob and rank and the ``logprobs`` most likely tokens, for the
        rows that report logprobs or rank completions by them (None for the others)."""
        result: List[Optional[TokenLogprobs]] = [None] * len(params)
        rows = np.array([r for r, p in enumerate(params) if p.logprobs is not None or p.ranks_completions],
                        dtype=np.int64)
        if rows.size == 0:
            return result
        logp = _log_softmax(raw_logits[rows].astype(np.float64))
        chosen = token_ids[rows]
        chosen_logp = logp[np.arange(rows.size), chosen]
        chosen_rank = (logp > chosen_logp[:, None]).sum(axis=1) + 1

        max_k = min(max(params[r].logprobs or 0 for r in rows), logp.shape[1])
        if max_k > 0:
            candidates = np.argpartition(-logp, max_k - 1, axis=1)[:, :max_k]
            candidate_logp = np.take_along_axis(logp, candidates, axis=1)
            # Most likely first; equal logprobs by token id, for determinism.
            by_rank = np.lexsort((candidates, -candidate_logp), axis=1)
            top_ids = np.take_along_axis(candidates, by_rank, axis=1)
            top_logp = np.take_along_axis(candidate_logp, by_rank, axis=1)

        text = self.decode_token or (lambda token_id: None)
        for i, row in enumerate(rows):
            k = min(params[row].logprobs or 0, logp.shape[1])
            top: StepLogprobs = {}
            if k > 0:
                descending = -top_logp[i, :k]
                # Ties share a rank: 1 + count of strictly more likely tokens.
                ranks = np.searchsorted(descending, descending, side="left") + 1
                top = {int(t): Logprob(float(lp), int(rk), text(int(t)))
                       for t, lp, rk in zip(top_ids[i, :k], top_logp[i, :k], ranks)}
            token = int(chosen[i])
            result[row] = TokenLogprobs(token, float(chosen_logp[i]), int(chosen_rank[i]), top,
                                        top[token].decoded_token if token in top else text(token))
        return result
