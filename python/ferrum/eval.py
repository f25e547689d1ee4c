"""Evaluation: perplexity, log-likelihood of continuations, exact match of greedy answers.

Every function takes a loaded ``ferrum.LLM`` and runs all of its items through the engine
together (``LLM.token_logprobs`` / ``LLM.generate`` with many sequences), so a benchmark of
hundreds of items costs a few large forwards.
"""
from __future__ import annotations

import math
import re
import string
import unicodedata
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np

from .sampling import SamplingParams

TextOrIds = Union[str, Sequence[int]]


# ---- perplexity ----------------------------------------------------------------------------

@dataclass
class PerplexityResult:
    perplexity: float   # exp(nll / num_tokens)
    nll: float          # summed negative log-likelihood of the scored tokens, in nats
    num_tokens: int     # tokens scored (see sliding_windows)
    num_windows: int

    @property
    def nll_per_token(self) -> float:
        return self.nll / self.num_tokens


def sliding_windows(num_tokens: int, window: int, stride: int) -> List[Tuple[int, int, int]]:
    """(begin, end, first_scored) per window, as in Hugging Face's perplexity guide: a window
    of up to `window` tokens starts every `stride` tokens and scores only the tokens that no
    earlier window scored, each with at least ``window - stride`` tokens of context once the
    first window is past. With stride < window every token but the first is scored once; with
    stride == window (disjoint windows) the first token of each window has no context there
    and is not scored either."""
    out, scored_to = [], 1
    for begin in range(0, num_tokens, stride):
        end = min(begin + window, num_tokens)
        out.append((begin, end, max(scored_to, begin + 1)))
        scored_to = end
        if end == num_tokens:
            break
    return out


def perplexity(llm, text_or_token_ids: TextOrIds, window: Optional[int] = None,
               stride: Optional[int] = None) -> PerplexityResult:
    """Perplexity of a text (encoded with the model's tokenizer, BOS included when the model
    uses one) or of token ids, with sliding windows of `window` tokens (default: the model's
    context length) moved `stride` tokens at a time (default: window // 2)."""
    ids = _token_ids(llm, text_or_token_ids, "text")
    if len(ids) < 2:
        raise ValueError(f"perplexity needs at least 2 tokens, got {len(ids)}")
    window = llm.runner.max_model_len if window is None else window
    if not _is_int(window) or window < 2:
        raise ValueError(f"window must be an integer >= 2, got {window!r}")
    if window > llm.runner.max_model_len:
        raise ValueError(f"window {window} exceeds the model's max_model_len {llm.runner.max_model_len}")
    stride = max(1, window // 2) if stride is None else stride
    if not _is_int(stride) or not 1 <= stride <= window:
        raise ValueError(f"stride must be an integer in [1, window={window}], got {stride!r}")
    spans = sliding_windows(len(ids), window, stride)
    scores = llm.token_logprobs([ids[b:e] for b, e, _ in spans], start=[f - b for b, e, f in spans])
    nll = -sum(s.total for s in scores)
    count = sum(len(s.logprobs) for s in scores)
    return PerplexityResult(math.exp(nll / count), nll, count, len(spans))


# ---- log-likelihood ------------------------------------------------------------------------

@dataclass
class LoglikelihoodResult:
    logprob: float      # summed log-probability of the continuation's tokens, given the context
    is_greedy: bool     # greedy decoding from the context would produce exactly the continuation
    num_tokens: int     # tokens in the continuation


def loglikelihood(llm, pairs: Sequence[Tuple[TextOrIds, TextOrIds]]) -> List[LoglikelihoodResult]:
    """log P(continuation | context) for each (context, continuation) pair, all scored together.

    Text pairs are encoded as one string, ``context + continuation``, and the continuation is
    the tokens after the longest common prefix with the encoded context: a word split
    differently at the boundary belongs to the continuation (as lm-evaluation-harness does)."""
    pairs = list(pairs)
    if not pairs:
        raise ValueError("loglikelihood needs at least one (context, continuation) pair")
    seqs, starts = [], []
    for pair in pairs:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise ValueError(f"each item must be a (context, continuation) pair, got {pair!r}")
        ids, start = _split_pair(llm, *pair)
        seqs.append(ids)
        starts.append(start)
    scores = llm.token_logprobs(seqs, start=starts)
    return [LoglikelihoodResult(s.total, bool(s.greedy.all()), len(s.logprobs)) for s in scores]


def _split_pair(llm, context: TextOrIds, continuation: TextOrIds) -> Tuple[List[int], int]:
    if isinstance(context, str) != isinstance(continuation, str):
        raise ValueError("context and continuation must both be text or both be token ids")
    if isinstance(context, str):
        if not continuation:
            raise ValueError("the continuation is empty")
        ctx = llm.tokenizer.encode(context)
        ids = llm.tokenizer.encode(context + continuation)
        start = 0
        while start < min(len(ctx), len(ids)) and ctx[start] == ids[start]:
            start += 1
        if start == len(ids):
            raise ValueError(f"the continuation {continuation!r} adds no tokens")
    else:
        ctx, cont = _token_ids(llm, context, "context"), _token_ids(llm, continuation, "continuation")
        if not cont:
            raise ValueError("the continuation is empty")
        ids, start = ctx + cont, len(ctx)
    if start == 0:
        raise ValueError("the context is empty and the tokenizer adds no BOS: the first "
                         "continuation token has nothing to be predicted from")
    return ids, start


# ---- exact match ---------------------------------------------------------------------------

def normalize_answer(text: str) -> str:
    """SQuAD-style: Unicode NFKC, lower case, no punctuation, no English articles, single spaces."""
    text = unicodedata.normalize("NFKC", text).lower()
    text = "".join(" " if ch in string.punctuation else ch for ch in text)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


MATCH_MODES = ("exact", "prefix", "contains")


@dataclass
class ExactMatchItem:
    prompt: str
    expected: List[str]   # acceptable answers
    output: str           # the greedy generation
    correct: bool


@dataclass
class ExactMatchResult:
    accuracy: float
    items: List[ExactMatchItem] = field(default_factory=list)

    @property
    def num_correct(self) -> int:
        return sum(i.correct for i in self.items)


def exact_match(llm, items: Sequence[Tuple[str, Union[str, Sequence[str]]]], *, max_tokens: int = 32,
                chat: bool = False, system: Optional[str] = None, match: str = "exact",
                stop: Sequence[str] = ("\n",)) -> ExactMatchResult:
    """Greedy answers to each (prompt, expected) pair, compared after `normalize_answer`.

    expected: one answer or a list of acceptable ones. chat: wrap each prompt as a user
    message (after an optional system message) in the model's chat template. match: "exact"
    (the normalised output equals an answer), "prefix" (starts with one, as whole words) or
    "contains" (contains one as whole words). Generation stops at any of `stop`."""
    items = list(items)
    if not items:
        raise ValueError("exact_match needs at least one (prompt, expected) pair")
    if match not in MATCH_MODES:
        raise ValueError(f"match must be one of {MATCH_MODES}, got {match!r}")
    prompts, answers = [], []
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) != 2 or not isinstance(item[0], str):
            raise ValueError(f"each item must be a (prompt, expected) pair of text, got {item!r}")
        prompt, expected = item
        expected = [expected] if isinstance(expected, str) else list(expected)
        if not prompt or not expected or not all(isinstance(e, str) and normalize_answer(e) for e in expected):
            raise ValueError(f"empty prompt or expected answer in {item!r}")
        prompts.append(_chat_prompt(llm, prompt, system) if chat else prompt)
        answers.append(expected)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=list(stop) or None)
    outputs = llm.generate(prompts, params)
    results = []
    for (prompt, _), expected, out in zip(items, answers, outputs):
        text = out.outputs[0].text
        correct = any(_matches(normalize_answer(text), normalize_answer(e), match) for e in expected)
        results.append(ExactMatchItem(prompt, expected, text, correct))
    return ExactMatchResult(sum(r.correct for r in results) / len(results), results)


def _matches(output: str, answer: str, mode: str) -> bool:
    if mode == "exact":
        return output == answer
    if mode == "prefix":
        return output == answer or output.startswith(answer + " ")
    return f" {answer} " in f" {output} "


def _chat_prompt(llm, prompt: str, system: Optional[str]) -> str:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)


# ---- helpers -------------------------------------------------------------------------------

def _token_ids(llm, value: TextOrIds, what: str) -> List[int]:
    if isinstance(value, str):
        if not value:
            raise ValueError(f"the {what} is empty")
        return llm.tokenizer.encode(value)
    ids = np.asarray(value)
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(f"the {what} must be a string or a 1-D sequence of token ids")
    return [int(t) for t in ids]


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)
