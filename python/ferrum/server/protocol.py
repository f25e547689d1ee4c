"""Request bodies of the OpenAI-compatible API (OpenAI's fields, plus vLLM's extensions), and
their translation into ``SamplingParams``.

A field ferrum does not know is a 400 naming it (as OpenAI answers an unknown parameter), so
that nothing a client asks for is silently dropped; values out of range are a 400 too. vLLM's
older ``guided_*`` fields and llama.cpp's ``grammar`` / ``json_schema`` are honoured as
``structured_outputs``.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..sampling import SamplingParams
from ..structured import StructuredOutputsParams

MAX_N = 16  # completions per prompt
MAX_LOGPROBS = 20  # most likely tokens reported per position (vLLM's default limit)
SEED_RANGE = dict(ge=-(2 ** 63), le=2 ** 64 - 1)


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(OpenAIModel):
    include_usage: bool = False


class StructuredOutputs(OpenAIModel):
    """vLLM's ``structured_outputs`` request field: exactly one constraint."""
    json_schema: Union[str, Dict[str, Any], None] = Field(None, alias="json")
    regex: Optional[str] = None
    choice: Optional[List[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: bool = False

    def params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=self.json_schema, regex=self.regex, choice=self.choice,
                                       grammar=self.grammar, json_object=self.json_object,
                                       disable_any_whitespace=self.disable_any_whitespace)


class JsonSchemaFormat(OpenAIModel):
    name: str = "response"
    description: Optional[str] = None
    json_schema: Dict[str, Any] = Field(alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema")
        return self

    def structured(self) -> Optional[StructuredOutputsParams]:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            return StructuredOutputsParams(json=self.json_schema.json_schema)
        return None


class SamplingRequest(OpenAIModel):
    """The fields completions and chat completions share."""
    model: Optional[str] = None
    # ferrum's: the request's scale of the LoRA adapter `model` names (llama.cpp's per-request
    # scale), on top of the adapter's alpha / r.
    lora_scale: Optional[float] = Field(None, allow_inf_nan=False)
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: Optional[float] = Field(None, ge=0, le=100)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=-1)
    min_p: Optional[float] = Field(None, ge=0, le=1)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    repetition_penalty: Optional[float] = Field(None, ge=0.01, le=100)  # no overflow dividing by it
    logit_bias: Optional[Dict[str, float]] = None
    stop: Union[str, List[str], None] = None
    stop_token_ids: Optional[List[int]] = None
    seed: Optional[int] = Field(None, **SEED_RANGE)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputs] = None
    best_of: Optional[int] = Field(None, ge=1, le=MAX_N)
    # vLLM's older names for structured_outputs, and llama.cpp's
    guided_json: Union[str, Dict[str, Any], None] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[List[str]] = None
    guided_grammar: Optional[str] = None
    grammar: Optional[str] = None  # llama.cpp: GBNF
    json_schema: Optional[Dict[str, Any]] = None  # llama.cpp
    # Labels and hints that ask nothing of the output.
    user: Optional[str] = None
    metadata: Optional[Dict[str, str]] = None
    safety_identifier: Optional[str] = None
    prompt_cache_key: Optional[str] = None  # prefix caching reuses prompts by itself
    service_tier: Optional[Literal["auto", "default"]] = None
    store: Optional[Literal[False]] = None  # ferrum keeps no chat completions

    @model_validator(mode="after")
    def _best_of_whole(self):
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise ValueError("best_of > n cannot stream: the best completions are known only at the end")
        return self

    def _structured(self) -> Optional[StructuredOutputsParams]:
        """The one constraint the request gives, under any of its names; ValueError for two."""
        given = {}
        if self.response_format is not None and self.response_format.structured() is not None:
            given["response_format"] = self.response_format.structured()
        if self.structured_outputs is not None:
            given["structured_outputs"] = self.structured_outputs.params()
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar"), ("grammar", "grammar"), ("json_schema", "json")):
            if getattr(self, name) is not None:
                given[name] = StructuredOutputsParams(**{key: getattr(self, name)})
        if len(given) > 1:
            raise ValueError(f"give one constraint, not {' and '.join(given)}")
        return next(iter(given.values()), None)

    def sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int], vocab_size: int) -> SamplingParams:
        """ValueError for a value SamplingParams or the vocabulary rejects."""
        bias = None
        if self.logit_bias:
            bias = {}
            for key, value in self.logit_bias.items():
                try:
                    token = int(key)
                except ValueError:
                    raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
                if not 0 <= token < vocab_size:
                    raise ValueError(f"logit_bias token id {token} is out of range [0, {vocab_size})")
                bias[token] = min(max(value, -100.0), 100.0)  # OpenAI's range
        structured = self._structured()
        return SamplingParams(
            n=self.n, best_of=self.best_of, max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
            min_p=self.min_p or 0.0, presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0, logit_bias=bias, stop=self.stop,
            stop_token_ids=self.stop_token_ids, seed=self.seed, ignore_eos=self.ignore_eos,
            logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
            structured_outputs=structured)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


TokenIds = List[int]


def _inputs(p, what: str) -> List[Union[str, TokenIds]]:
    """A text, texts, token ids or lists of token ids as a list of texts or token id lists."""
    if isinstance(p, str) or (p and isinstance(p[0], int)):
        return [p]
    if not p:
        raise ValueError(f"{what} is empty")
    return list(p)


class CompletionRequest(SamplingRequest):
    prompt: Union[str, List[str], TokenIds, List[TokenIds]]
    max_tokens: Optional[int] = Field(16, ge=0)
    echo: bool = False
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: Optional[str] = None

    @model_validator(mode="after")
    def _supported(self):
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be at least 1 unless echo is set")
        if self.max_tokens == 0 and self.stream:
            raise ValueError("max_tokens=0 cannot stream")
        return self

    def prompts(self) -> List[Union[str, TokenIds]]:
        return _inputs(self.prompt, "the prompt")


class ContentPart(OpenAIModel):
    type: str
    text: Optional[str] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # tool_calls, tool_call_id, ...: the template reads them
    role: str
    content: Union[str, List[ContentPart], None] = None
    name: Optional[str] = None

    def for_template(self) -> dict:
        """The message as chat templates read it: text content as one string."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            if any(part.type != "text" or part.text is None for part in self.content):
                raise ValueError("only text content parts are supported")
            message["content"] = "".join(part.text for part in self.content)
        if self.role == "assistant" and isinstance(message.get("tool_calls"), list):
            message.setdefault("content", "")
            message["tool_calls"] = [_call_for_template(c) for c in message["tool_calls"]]
        return message


def _call_for_template(call: Any) -> Any:
    """An assistant's tool call as templates read it: the arguments as an object (OpenAI sends
    JSON text; Llama's and Qwen's templates write ``arguments | tojson``), and the function's
    fields also at the top (Qwen's reads ``tool_call.function`` or the call itself)."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise ValueError(f"an assistant tool call must be {{'id', 'type', 'function': {{'name', 'arguments'}}}}, got {call!r}")
    function = dict(call["function"])
    if isinstance(function.get("arguments"), str):
        try:
            function["arguments"] = json.loads(function["arguments"])
        except ValueError:
            raise ValueError(f"tool call arguments must be JSON, got {function['arguments']!r}") from None
    return {**call, "function": function}


class ChatCompletionRequest(SamplingRequest):
    messages: List[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[int] = Field(None, ge=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Union[str, Dict[str, Any], None] = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[Dict[str, Any]] = None

    @property
    def completion_limit(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def logprobs_count(self) -> Optional[int]:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(OpenAIModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered through the chat template."""
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[List[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: Optional[List[Dict[str, Any]]] = None
    chat_template_kwargs: Optional[Dict[str, Any]] = None

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(OpenAIModel):
    model: Optional[str] = None
    tokens: List[int]


class LoadLoRAAdapterRequest(OpenAIModel):
    """vLLM's /v1/load_lora_adapter; load_inplace: replace the adapter served under that name."""
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(OpenAIModel):
    """vLLM's /v1/unload_lora_adapter (vLLM also takes, and ignores, ``lora_int_id``)."""
    lora_name: str
    lora_int_id: Optional[int] = None


class EmbeddingRequest(OpenAIModel):
    """OpenAI's /v1/embeddings: ``input`` as a text, texts, token ids or lists of token ids."""
    model: Optional[str] = None
    input: Union[str, List[str], TokenIds, List[TokenIds]]
    # ferrum's: the request's scale of the LoRA adapter `model` names (llama.cpp's per-request
    # scale), on top of the adapter's alpha / r.
    lora_scale: Optional[float] = Field(None, allow_inf_nan=False)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Optional[int] = Field(None, ge=1)
    user: Optional[str] = None

    def inputs(self) -> List[Union[str, TokenIds]]:
        return _inputs(self.input, "input")


class ResponsesRequest(BaseModel):
    """OpenAI's /v1/responses. Unlike the older routes, a field ferrum does not know is a 400
    (as OpenAI answers an unknown parameter)."""
    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = None
    input: Union[str, List[Dict[str, Any]]]
    # ferrum's: the request's scale of the LoRA adapter `model` names (llama.cpp's per-request
    # scale), on top of the adapter's alpha / r.
    lora_scale: Optional[float] = Field(None, allow_inf_nan=False)
    instructions: Optional[str] = None
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Union[str, Dict[str, Any], None] = None
    parallel_tool_calls: bool = True
    max_output_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    stream: bool = False
    previous_response_id: Optional[str] = None
    store: bool = True
    metadata: Optional[Dict[str, str]] = None
    text: Optional[Dict[str, Any]] = None
    reasoning: Optional[Dict[str, Any]] = None
    truncation: Literal["disabled"] = "disabled"
    user: Optional[str] = None
    seed: Optional[int] = Field(None, **SEED_RANGE)  # vLLM's extension
    prompt_cache_key: Optional[str] = None  # a hint; prefix caching reuses prompts by itself
    service_tier: Optional[Literal["auto", "default"]] = None
    include: Optional[List[str]] = None

    @model_validator(mode="after")
    def _nothing_to_include(self):
        if self.include:
            raise ValueError(f"include: ferrum adds nothing to a response's output, got {self.include}")
        return self
