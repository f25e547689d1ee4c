"""Deciding when a sequence is finished and how much text is safe to stream.

``StopChecker`` finds stop strings in incrementally growing text (a stop
string may span several token deltas) and tells how much text can be shown
without risking a later stop-string match.  ``RequestProgress`` drives one
completion token by token, vLLM-style:

* EOS (unless ``ignore_eos``; a structured output's EOS, which its grammar
  allows only once complete, always) or a ``stop_token_ids`` hit -> "stop"; the
  token id is kept in ``token_ids`` but its text is not added to the output.
* A stop string -> "stop"; the output is cut before it (stop string excluded,
  vLLM's default ``include_stop_str_in_output=False``).
* ``max_tokens`` generated -> "length".

Pure Python: importable without the compiled ``ferrum._core``.
"""
from __future__ import annotations

import numbers
from typing import Iterable, List, Optional, Tuple, Union

from .outputs import CompletionOutput, StepLogprobs
from .sampling import SamplingParams, TokenLogprobs


class StopChecker:
    """Stop-string search over text that only grows at the end."""

    def __init__(self, stop_strings: Iterable[str]):
        self.stop_strings = [s for s in stop_strings]
        if any(s == "" for s in self.stop_strings):
            raise ValueError("stop strings must be non-empty")
        self._longest = max((len(s) for s in self.stop_strings), default=0)

    def find(self, text: str, new_from: int = 0) -> Optional[Tuple[int, str]]:
        """Earliest stop string in ``text`` that ends after ``new_from``.

        ``new_from`` is the length the text had before its newest delta; text
        before it was already checked, so only a window of ``longest - 1``
        characters back is rescanned.  Returns ``(start, stop_string)`` or
        None.  Among matches at the same start the shortest wins (it completed
        first).
        """
        best: Optional[Tuple[int, str]] = None
        for stop in self.stop_strings:
            start = text.find(stop, max(0, new_from - len(stop) + 1))
            if start != -1 and (best is None or (start, len(stop)) < (best[0], len(best[1]))):
                best = (start, stop)
        return best

    def safe_length(self, text: str) -> int:
        """Length of the prefix of ``text`` that no future text can turn into a
        stop-string match: hold back the longest suffix that is a proper
        prefix of some stop string."""
        held = 0
        for stop in self.stop_strings:
            for size in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:size]):
                    held = size
                    break
        return len(text) - held


class RequestProgress:
    """One completion's output state, advanced once per generated token.

    ``eos_token_ids`` are the tokenizer's end-of-sequence ids (ignored when
    ``params.ignore_eos``, unless the output is structured: its grammar's end is the end).
    """

    def __init__(self, params: SamplingParams,
                 eos_token_ids: Union[None, int, Iterable[int]] = None, index: int = 0):
        self.params = params
        self.index = index
        if eos_token_ids is None:
            eos_token_ids = ()
        elif isinstance(eos_token_ids, numbers.Integral):
            eos_token_ids = (eos_token_ids,)
        ends_at_eos = not params.ignore_eos or params.structured_outputs is not None
        self._eos_ids = frozenset(eos_token_ids) if ends_at_eos else frozenset()
        self._stop_ids = frozenset(params.stop_token_ids or ())
        self._checker = StopChecker(params.stop or ())

        self.token_ids: List[int] = []
        self._text = ""      # all accepted text, including any held-back tail
        self._emitted = 0    # how much of _text has been handed out
        self.finish_reason: Optional[str] = None
        self.stop_reason: Union[int, str, None] = None
        self.length_limit: Optional[str] = None  # which limit a "length" finish reached
        self.cumulative_logprob: Optional[float] = (
            0.0 if params.logprobs is not None or params.ranks_completions else None)
        self.logprobs: Optional[List[StepLogprobs]] = [] if params.logprobs is not None else None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """Text handed out so far; the final output text once finished."""
        return self._text[:self._emitted]

    def append(self, token_id: int, text_delta: str,
               logprobs: Optional[TokenLogprobs] = None) -> Tuple[str, bool, Optional[str]]:
        """Accept one sampled token and its detokenised text.

        Returns ``(emit_text, finished, finish_reason)``: ``emit_text`` is the
        new text that is safe to stream now (all remaining text once finished).
        """
        if self.finished:
            raise RuntimeError("append() on a finished request")
        token_id = int(token_id)
        self.token_ids.append(token_id)
        if logprobs is not None and self.cumulative_logprob is not None:
            self.cumulative_logprob += logprobs.logprob
        if logprobs is not None and self.logprobs is not None:
            self.logprobs.append(logprobs.as_step_logprobs())

        if token_id in self._eos_ids:
            return self._finish("stop", None)
        if token_id in self._stop_ids:
            return self._finish("stop", token_id)

        checked_up_to = len(self._text)
        self._text += text_delta
        match = self._checker.find(self._text, checked_up_to)
        if match is not None:
            start, stop = match
            self._text = self._text[:start]
            return self._finish("stop", stop)
        if self.params.max_tokens is not None and len(self.token_ids) >= self.params.max_tokens:
            return self._finish("length", None, "max_tokens")
        return self._emit(self._checker.safe_length(self._text)), False, None

    def finish(self, reason: str, length_limit: Optional[str] = None) -> str:
        """End the request from outside ("abort", or "length" with the limit reached:
        "max_model_len", "kv_cache"). Returns any text still held back."""
        if self.finished:
            return ""
        return self._finish(reason, None, length_limit)[0]

    def to_output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            length_limit=self.length_limit,
        )

    def _emit(self, up_to: int) -> str:
        # A stop-string cut never reaches into emitted text (that tail was held
        # back), but clamp anyway so emitted text is never taken back.
        up_to = max(up_to, self._emitted)
        chunk = self._text[self._emitted:up_to]
        self._emitted = up_to
        return chunk

    def _finish(self, reason: str, stop_reason, length_limit: Optional[str] = None) -> Tuple[str, bool, str]:
        self.finish_reason = reason
        self.stop_reason = stop_reason
        self.length_limit = length_limit
        # Nothing more can arrive, so a held-back partial stop string is real text.
        return self._emit(len(self._text)), True, reason
