"""Result types handed back to users, shaped like vLLM's ``vllm.outputs``.

Pure Python: importable without the compiled ``ferrum._core``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Union


@dataclass
class Logprob:
    """One token's log-probability at one step (vLLM's ``Logprob``).

    ``rank`` is 1-based: 1 + the number of vocabulary tokens with a strictly
    higher log-probability at that step.
    """

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None  # the token alone, decoded (special tokens as their text)


# Per generated step: token id -> Logprob (the top-k plus the sampled token).
StepLogprobs = Dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One of the ``n`` completions of a request.

    ``cumulative_logprob`` and ``logprobs`` are None unless the request asked
    for logprobs (``SamplingParams.logprobs`` not None), as in vLLM.
    ``finish_reason`` is None while running, then "stop" or "length";
    ``stop_reason`` says which stop string / stop token id ended it (None for
    EOS or length). ``length_limit`` says which limit a "length" finish reached:
    "max_tokens", "max_model_len" (the context is full) or "kv_cache" (the
    sequence alone fills the KV cache); None for any other finish.
    """

    index: int
    text: str
    token_ids: List[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[List[StepLogprobs]]
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    length_limit: Optional[str] = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Everything produced for one request so far (final when ``finished``)."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    outputs: List[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    # SamplingParams(prompt_logprobs=k): None for the first prompt token (nothing predicts it),
    # then each prompt token's Logprob and the k most likely tokens at its position.
    prompt_logprobs: Optional[List[Optional[StepLogprobs]]] = None


@dataclass
class EmbeddingOutput:
    """One prompt's embedding (vLLM's ``EmbeddingOutput``): its final hidden state pooled over
    the prompt (``LLM.embed``'s ``pooling``), L2-normalised unless asked otherwise; with
    pooling="all", one such row per prompt position."""

    embedding: Union[List[float], List[List[float]]]

    @property
    def hidden_size(self) -> int:
        first = self.embedding[0] if self.embedding else None
        return len(first) if isinstance(first, list) else len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What ``LLM.embed`` returns per prompt (vLLM's ``EmbeddingRequestOutput``)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: List[int]
    finished: bool = True


@dataclass
class CompletionDelta:
    """What one completion produced in one engine step: the new token ids, the text that became
    safe to show (whole characters, nothing that might still turn into a stop string), and the
    finish reason once it ends."""

    index: int
    text: str
    token_ids: List[int]
    finish_reason: Optional[str] = None
    stop_reason: Union[int, str, None] = None
    logprobs: Optional[List[StepLogprobs]] = None  # one per new token, when the request asked
    length_limit: Optional[str] = None  # as CompletionOutput's


@dataclass
class RequestDelta:
    """One request's progress in one engine step (``LLM.step()``). ``outputs`` holds only the
    completions that changed; ``output`` is the complete ``RequestOutput`` once ``finished``."""

    request_id: str
    outputs: List[CompletionDelta]
    finished: bool = False
    output: Optional[RequestOutput] = None

    def text(self, index: int = 0) -> str:
        """New text of completion ``index`` in this step ("" when it produced none)."""
        return "".join(d.text for d in self.outputs if d.index == index)

    @staticmethod
    def merge(deltas: List["RequestDelta"]) -> "RequestDelta":
        """Consecutive deltas of one request as one: each completion's text, token ids and
        logprobs joined in order, its finish reason the last one's."""
        if len(deltas) == 1:
            return deltas[0]
        merged: Dict[int, CompletionDelta] = {}
        for delta in deltas:
            for d in delta.outputs:
                m = merged.get(d.index)
                if m is None:
                    merged[d.index] = CompletionDelta(d.index, d.text, list(d.token_ids), d.finish_reason,
                                                      d.stop_reason, None if d.logprobs is None else list(d.logprobs),
                                                      d.length_limit)
                    continue
                m.text += d.text
                m.token_ids += d.token_ids
                if d.logprobs is not None:
                    m.logprobs = (m.logprobs or []) + d.logprobs
                if d.finish_reason is not None:
                    m.finish_reason, m.stop_reason, m.length_limit = d.finish_reason, d.stop_reason, d.length_limit
        last = deltas[-1]
        return RequestDelta(last.request_id, list(merged.values()), last.finished, last.output)
