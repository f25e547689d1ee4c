"""Structured output: generation constrained to a JSON schema, a regex, a list of choices or a
grammar (Lark, or llama.cpp's GBNF), through llguidance.

``SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))`` (vLLM's names).
Each completion gets its own ``GrammarConstraint``: before a step samples its row, the
constraint catches its matcher up with the tokens generated so far and masks every token the
grammar forbids to -inf, so whatever the sampler picks (greedy, sampled, or a verified
proposal of speculative decoding) keeps the output inside the grammar. Once the grammar is
complete only an end-of-sequence token is allowed, which ends the completion.

llguidance is imported when a constraint is first built: ``import ferrum`` does not need it.
"""
from __future__ import annotations

import json as _json
import re
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Union

import numpy as np


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint: ``json`` (a JSON schema, dict or text), ``json_object`` (any JSON
    object), ``regex``, ``choice`` (one of these strings) or ``grammar`` (Lark or GBNF text).
    ValueError when it is missing, ambiguous or does not compile. JSON may hold any whitespace
    between tokens unless ``disable_any_whitespace`` (then none: a model that would pad it
    forever cannot)."""

    json: Union[str, dict, None] = None
    regex: Optional[str] = None
    choice: Optional[List[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: bool = False
    # Lazy: the constraint engages at the first of these strings in the output and holds the
    # output from that string on (a Lark ``grammar`` whose ``start`` begins with it); before
    # it the output is free. A model that writes a trigger the grammar cannot follow stays free.
    triggers: Optional[List[str]] = None
    _grammar: str = field(init=False, repr=False, compare=False, default="")  # compiled once, here

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured outputs take exactly one of json, regex, choice, grammar, "
                             f"json_object; got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"json must be a JSON schema (a dict or its text), got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise ValueError(f"choice must be a non-empty list of non-empty strings, got {self.choice!r}")
            self.choice = list(self.choice)
        if self.triggers is not None:
            if (not isinstance(self.triggers, (list, tuple)) or not self.triggers
                    or not all(isinstance(t, str) and t for t in self.triggers)):
                raise ValueError(f"triggers must be a non-empty list of non-empty strings, got {self.triggers!r}")
            if self.grammar is None or not _START_RULE.search(self.grammar):
                raise ValueError("triggers need a Lark grammar with a `start` rule")
            self.triggers = list(self.triggers)
        for name in ("json_object", "disable_any_whitespace"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be True or False, got {value!r}")
        self._grammar = self._to_llguidance()
        error = _llguidance().LLMatcher.validate_grammar(self._grammar)
        if error:
            raise ValueError(f"the {given[0]} constraint does not compile: {error}")

    def llguidance_grammar(self) -> str:
        """The constraint as an llguidance grammar (what ``LLMatcher`` takes)."""
        return self._grammar

    def _to_llguidance(self) -> str:
        ll = _llguidance()
        try:
            if self.json is not None or self.json_object:
                schema = self.json if self.json is not None else {"type": "object"}
                options = {"whitespace_flexible": not self.disable_any_whitespace}
                return ll.LLMatcher.grammar_from_json_schema(schema, overrides=options)
            if self.regex is not None:
                return ll.grammar_from("regex", self.regex)
            if self.choice is not None:
                return ll.grammar_from("choice", _json.dumps(self.choice))
            return ll.grammar_from("grammar", self.grammar)  # Lark, or GBNF converted to Lark
        except ValueError as e:  # a schema that is not JSON, a GBNF that does not convert
            raise ValueError(f"invalid structured output constraint: {e}") from None


_START_RULE = re.compile(r"(?m)^start\s*:")
TRIGGER_WINDOW_TOKENS = 16  # a trigger is looked for in the text of the last tokens (and the new ones)


class GrammarConstraint:
    """One completion's llguidance matcher and its token mask over the model's vocabulary; with
    ``params.triggers``, no matcher (and no mask) until the output shows a trigger."""

    def __init__(self, params: StructuredOutputsParams, tokenizer, vocab_size: int):
        self._ll_tokenizer = llguidance_tokenizer(tokenizer)
        self._tokenizer = tokenizer
        self._params = params
        self.vocab_size = vocab_size
        self._bitmask = np.zeros((self._ll_tokenizer.vocab_size + 31) // 32, dtype=np.int32)
        self._consumed = 0  # generated tokens the matcher has seen (or, lazy, looked through)
        self.matcher = None
        self.free = False  # lazy, and the trigger came in a form the grammar cannot follow
        if not params.triggers:
            self.matcher = self._matcher(params.llguidance_grammar())

    def _matcher(self, grammar: str):
        matcher = _llguidance().LLMatcher(self._ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"invalid structured output constraint: {matcher.get_error()}")
        return matcher

    def _engage(self, output_token_ids: Sequence[int]) -> bool:
        """Lazy: builds the matcher once a trigger shows in the output. The token holding the
        trigger's start may begin with free text: the grammar is then that text, then the given
        grammar, so the matcher can take the tokens from there on."""
        window_start = max(0, min(self._consumed, len(output_token_ids)) - TRIGGER_WINDOW_TOKENS)
        window = list(output_token_ids[window_start:])
        self._consumed = len(output_token_ids)
        text = self._tokenizer.decode(window, skip_special_tokens=False)
        found = [i for i in (text.find(t) for t in self._params.triggers) if i >= 0]
        if not found:
            return False
        at = min(found)
        first = next(k for k in range(len(window))
                     if len(self._tokenizer.decode(window[:k + 1], skip_special_tokens=False)) > at)
        prefix = text[len(self._tokenizer.decode(window[:first], skip_special_tokens=False)):at]
        grammar = self._params.grammar
        if prefix:
            grammar = f"start: {_json.dumps(prefix)} triggered\n" + _START_RULE.sub("triggered:", grammar)
        matcher = self._matcher(_llguidance().grammar_from("grammar", grammar))
        if not matcher.consume_tokens(window[first:]):
            self.free = True  # e.g. the trigger spelled in other tokens than the grammar's
            return False
        self.matcher = matcher
        return True

    def apply(self, logits: np.ndarray, output_token_ids: Sequence[int]) -> None:
        """Sets to -inf, in place, the logits (one row of the model's vocabulary) of every token
        the grammar forbids after ``output_token_ids``."""
        start = time.perf_counter()
        if not self._caught_up(output_token_ids):
            return
        self._mask(logits)
        MASK_COST.add(time.perf_counter() - start)

    def greedy(self, logits: np.ndarray, top: int, output_token_ids: Sequence[int]) -> int:
        """The argmax of the masked row, given `top`, the row's own (first) argmax: `top` itself
        when the grammar allows it, which one token's check tells without a mask."""
        start = time.perf_counter()
        if not self._caught_up(output_token_ids):
            return top
        if not (top < self._ll_tokenizer.vocab_size and self.matcher.validate_tokens([top]) == 1):
            row = np.array(logits, dtype=np.float64)
            self._mask(row)
            top = int(np.argmax(row))
        MASK_COST.add(time.perf_counter() - start)
        return top

    def _caught_up(self, output_token_ids: Sequence[int]) -> bool:
        """Whether the grammar holds the next token (lazy: not before the trigger); if so, the
        matcher has taken every token generated so far."""
        if self.matcher is None and (self.free or not self._engage(output_token_ids)):
            return False
        new = list(output_token_ids[self._consumed:])
        if new and not self.matcher.consume_tokens(new):
            raise RuntimeError(f"a constrained completion left its grammar: {self.matcher.get_error()}")
        self._consumed = len(output_token_ids)
        return True

    def _mask(self, logits: np.ndarray) -> None:
        self.matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        allowed = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
        n = min(len(allowed), self.vocab_size)
        logits[:n][allowed[:n] == 0] = -np.inf
        logits[n:] = -np.inf  # ids the tokenizer does not have


class MaskCost:
    """What computing and applying token masks has cost in this process: ``steps`` masks,
    ``seconds`` in all (the server exports both; the benchmark reports the mean)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.steps = 0
        self.seconds = 0.0

    def add(self, seconds: float) -> None:
        with self._lock:
            self.steps += 1
            self.seconds += seconds

    def snapshot(self) -> Dict[str, float]:
        with self._lock:
            return {"steps": self.steps, "seconds": self.seconds}


MASK_COST = MaskCost()

_TOKENIZERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_TOKENIZERS_LOCK = threading.Lock()


def llguidance_tokenizer(tokenizer):
    """The llguidance view of a ``ferrum.Tokenizer`` (its Hugging Face tokenizer, which tells
    llguidance each token's bytes and how text is normalised), built once per tokenizer."""
    with _TOKENIZERS_LOCK:
        cached = _TOKENIZERS.get(tokenizer)
        if cached is None:
            if tokenizer.hf_tokenizer is None:
                raise ValueError("structured output needs a Hugging Face tokenizer (tokenizer.json or a GGUF "
                                 "vocabulary), not a SentencePiece tokenizer.model")
            if not tokenizer.eos_token_ids:
                raise ValueError("structured output needs a tokenizer with an end-of-sequence token")
            cached = _TOKENIZERS[tokenizer] = _llguidance().LLTokenizer(
                tokenizer.hf_tokenizer.to_str(), n_vocab=tokenizer.vocab_size,
                eos_token=sorted(tokenizer.eos_token_ids))
        return cached


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise ImportError("structured output needs llguidance: pip install ferrum[serve]") from None
    return llguidance
