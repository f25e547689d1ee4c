"""The user-facing API, shaped like vLLM's ``LLM``."""
from __future__ import annotations

import contextlib
import os
import threading
import weakref
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Union

import numpy as np

from . import _core, dist
from .embedding import PooledHiddenStates
from .engine import Engine, RowConsumer, token_ids_of
from .lora import LoraCache, LoRARequest, lora_storage
from .outputs import EmbeddingOutput, EmbeddingRequestOutput, RequestDelta, RequestOutput
from .prompt_embeds import PromptEmbeds, prompt_embeds_of
from .sampling import SamplingParams
from .scoring import LogitsCollector, LogprobCollector, TokenLogprobs
from .speculative import DraftModel, SpeculativeConfig
from .tokenizer import Tokenizer

# A prompt as vLLM takes it: text, {"prompt": text} (TextPrompt), {"prompt_token_ids": ids}
# (TokensPrompt) or, with enable_prompt_embeds, {"prompt_embeds": float32 [tokens, hidden]}
# (EmbedsPrompt); generate() and embed() take one or a list of them.
# A LoRA adapter per prompt, or one for all prompts (None: the base model).
LoraRequests = Union[LoRARequest, Sequence[Optional[LoRARequest]], None]
Prompt = Union[str, Dict[str, object]]
PromptType = Union[Prompt, Sequence[Prompt], None]
PROMPT_TYPES = ("a prompt is a str, {'prompt': str}, {'prompt_token_ids': [int, ...]} or "
                "{'prompt_embeds': float32 array [tokens, hidden]}")


class LLM:
    """A loaded model ready to generate.

    model: a directory (HF safetensors), a ``.gguf`` or llama2.c ``.bin`` file, a hub id
      (``org/name`` or ``org/name/file.gguf``), or None for the default SmolLM2-135M-Instruct.
    device: "cpu" or "opencl[:platform[:device]]".
    kv_dtype: "f16" (default), "f32" or "int8" for the paged KV cache.
    kv_cache_tokens / kv_cache_memory / kv_cache_memory_fraction: size the KV pool by tokens,
      bytes, or a fraction of the memory available when it is created (default 1 GiB).
    enable_prefix_caching: reuse the KV blocks of earlier prompts' full 16-token blocks.
    max_num_seqs / max_num_batched_tokens: at most this many sequences run at once and this
      many tokens (decodes plus prompt chunks) go into one forward.
    speculative_config: speculative decoding, as vLLM configures it: {"method": "ngram",
      "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2} or
      {"model": DRAFT_PATH, "num_speculative_tokens": 5}; a request may turn it off
      (SamplingParams(speculative_decoding=False)).
    enable_prompt_embeds: accept prompts given as embeddings, {"prompt_embeds": float32
      [tokens, hidden]} (docs/python-api.md); without it such a prompt is a ValueError.
    tensor_parallel_size: split the model between this many ranks (processes) over MPI: ranks
      started on this machine, or those of the ``mpirun -np N`` that started this script (ranks
      other than 0 serve rank 0 inside this call, then exit). docs/distributed.md.
    enable_lora: requests may name a LoRA adapter (``lora_request=ferrum.LoRARequest(name, id,
      path)``, a PEFT directory or a llama.cpp .gguf adapter), loaded on first use; up to
      max_loras different adapters run in one step (requests on others wait), each of rank <=
      max_lora_rank, and max_cpu_loras (default max_loras) stay loaded in host memory, least
      recently used dropped first. lora_dtype: what A and B are kept in, "auto" (as the file
      stores them: f32, f16, bf16 or a GGUF's q8_0), "float32", "float16", "bfloat16", or "q8_0"
      (rows that are not whole 32-element blocks, B's for ranks under 32, in f16). docs/lora.md.
    pipeline_parallel_size: split the model's layers between this many stages, each of
      ``tensor_parallel_size`` ranks (``tensor_parallel_size * pipeline_parallel_size`` ranks in
      all); the hidden rows pass from stage to stage. pipeline_layer_partition: layers per stage
      ("3,5" or [3, 5]; default ``FERRUM_PP_LAYER_PARTITION``, else the split of the most even
      cost).

    ``generate`` runs a list of prompts concurrently; ``stream`` yields one completion's text;
    ``add_request`` / ``step`` / ``abort`` / ``has_unfinished`` serve requests that arrive at
    any time (a server loop calls ``step()`` and forwards each request's delta). ``close()`` (or
    leaving a ``with LLM(...) as llm:`` block) releases the engine, the KV pool and the threads.
    """

    def __init__(self, model: Union[str, os.PathLike, None] = None, device: str = "cpu",
                 kv_dtype: str = "f16", num_threads: Optional[int] = None,
                 max_model_len: Optional[int] = None, *, tokenizer: Union[str, os.PathLike, None] = None,
                 kv_cache_tokens: Optional[int] = None, kv_cache_memory: Optional[int] = None,
                 kv_cache_memory_fraction: Optional[float] = None,
                 enable_prefix_caching: bool = True, max_num_seqs: int = 32,
                 max_num_batched_tokens: int = 512, speculative_config: Union[dict, str, None] = None,
                 tensor_parallel_size: int = 1, enable_prompt_embeds: bool = False, enable_lora: bool = False,
                 max_loras: int = 1, max_lora_rank: int = 16, max_cpu_loras: Optional[int] = None,
                 lora_dtype: str = "auto", pipeline_parallel_size: int = 1,
                 pipeline_layer_partition: Union[str, Sequence[int], None] = None):
        if kv_dtype not in ("f16", "f32", "int8"):
            raise ValueError(f"kv_dtype must be 'f16', 'f32' or 'int8', got {kv_dtype!r}")
        for name, v in (("num_threads", num_threads), ("max_model_len", max_model_len),
                        ("kv_cache_tokens", kv_cache_tokens), ("kv_cache_memory", kv_cache_memory),
                        ("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                        ("max_loras", max_loras), ("max_lora_rank", max_lora_rank), ("max_cpu_loras", max_cpu_loras)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name, v in (("enable_prefix_caching", enable_prefix_caching), ("enable_prompt_embeds", enable_prompt_embeds),
                        ("enable_lora", enable_lora)):
            if not isinstance(v, bool):
                raise ValueError(f"{name} must be True or False, got {v!r}")
        lora_storage(lora_dtype)
        self.enable_prompt_embeds = enable_prompt_embeds
        self.enable_lora = enable_lora
        fraction = kv_cache_memory_fraction
        if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
                                     or not 0 < fraction <= 1):
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], got {fraction!r}")
        if sum(v is not None for v in (kv_cache_tokens, kv_cache_memory, fraction)) > 1:
            raise ValueError("size the KV cache with one of kv_cache_tokens, kv_cache_memory, "
                             "kv_cache_memory_fraction")
        dist.check_sizes(tensor_parallel_size, pipeline_parallel_size)
        partition = dist.layer_partition(pipeline_layer_partition, pipeline_parallel_size)
        # under mpirun, ranks > 0 serve rank 0 here and exit
        group = dist.group(tensor_parallel_size, pipeline_parallel_size)
        weakref.finalize(self, dist.release, group)
        from .models import resolve_model  # here, not at import: `python -m ferrum.models` runs it fresh
        path = resolve_model(model)
        self.model_path = path
        # Parsed once: the tokenizer is built from the open file's metadata, which is then
        # dropped, before the weights load from the same file.
        model_file = _core.ModelFile(str(path))
        self.tokenizer = _load_tokenizer(path, model_file, tokenizer)
        with _load_progress(path, model_file.file_bytes) as progress:
            self._runner = _core.ModelRunner(
                model_file, device=device, num_threads=num_threads or 0, kv_dtype=kv_dtype,
                max_model_len=max_model_len or 0, kv_cache_tokens=kv_cache_tokens or 0,
                kv_cache_bytes=kv_cache_memory or 0, kv_cache_fraction=float(fraction or 0),
                prefix_cache=enable_prefix_caching, progress=progress, group=group,
                max_loras=max_loras if enable_lora else 0, max_lora_rank=max_lora_rank,
                pipeline_stages=pipeline_parallel_size, layer_partition=partition)
        self._loras = LoraCache(self._runner, max_cpu_loras or max_loras, lora_dtype) if enable_lora else None
        speculative = SpeculativeConfig.parse(speculative_config)
        draft = None
        if speculative is not None and speculative.method == "draft_model":
            draft = DraftModel(speculative.model, self.runner, device, num_threads or 0, max_num_seqs,
                               max_num_batched_tokens)
        self._engine = Engine(self.runner, self.tokenizer, max_num_seqs, max_num_batched_tokens, speculative, draft)
        # Deltas of requests that generate() / stream() drive, until they pick them up; and of
        # requests added with add_request(), until step() hands them out.
        self._mailboxes: Dict[str, List[RequestDelta]] = {}
        self._unclaimed: List[RequestDelta] = []
        # Calls from several threads interleave: one steps the engine at a time, and each
        # picks up its own requests' deltas, whichever thread's step produced them.
        self._lock = threading.RLock()

    @property
    def config(self) -> dict:
        return self.runner.config

    @property
    def runner(self):
        """The model (``ferrum._core.ModelRunner``); RuntimeError once closed."""
        if self._runner is None:
            raise RuntimeError("this LLM is closed")
        return self._runner

    @property
    def engine(self) -> Engine:
        """The continuous-batching engine; RuntimeError once closed."""
        if self._engine is None:
            raise RuntimeError("this LLM is closed")
        return self._engine

    def get_tokenizer(self):
        """The model's ``ferrum.Tokenizer`` (vLLM's ``LLM.get_tokenizer``)."""
        return self.tokenizer

    def close(self) -> None:
        """Releases the engine, its KV pool and its threads (and a draft model's); the LLM can no
        longer generate (RuntimeError), its tokenizer stays usable. Closing twice is harmless."""
        with self._lock:
            self._engine = self._runner = None
            self._mailboxes.clear()
            self._unclaimed = []

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- generation ----
    def generate(self, prompts: PromptType = None,
                 sampling_params: Union[SamplingParams, Sequence[SamplingParams], None] = None, *,
                 prompt_token_ids: Optional[Sequence[Sequence[int]]] = None,
                 use_tqdm: bool = False, lora_request: LoraRequests = None) -> List[RequestOutput]:
        """Runs every prompt concurrently through the engine; outputs in prompt order. prompts: a
        str, {"prompt": str}, {"prompt_token_ids": [...]} or a list of them (or token id lists
        given as prompt_token_ids). lora_request: a LoRARequest for all prompts or one per prompt
        (None: the base model; enable_lora)."""
        reqs = self._prepare(prompts, prompt_token_ids)
        params = self._params_list(sampling_params, len(reqs))
        loras = self._lora_list(lora_request, len(reqs))
        ids = []
        bar = _progress(len(reqs)) if use_tqdm else None
        try:
            with self._lock:
                for (text, toks), p, lora in zip(reqs, params, loras):
                    ids.append(self.engine.add_request(toks, p, prompt=text, lora=lora))
                    self._mailboxes[ids[-1]] = []
            done: Dict[str, RequestOutput] = {}
            while True:
                with self._lock:
                    for rid in ids:
                        for d in self._mailboxes[rid]:
                            if d.finished:
                                done[rid] = d.output
                                if bar:
                                    bar.update(1)
                        self._mailboxes[rid].clear()
                if len(done) == len(ids):
                    return [done[r] for r in ids]
                self._advance(lambda: any(self._mailboxes[r] for r in ids))
        finally:
            with self._lock:
                for rid in ids:
                    self._mailboxes.pop(rid, None)
                    self.engine.abort(rid)  # no-op for finished ones; frees the rest on errors
            if bar:
                bar.close()

    def stream(self, prompt: Union[Prompt, Sequence[int]],
               sampling_params: Optional[SamplingParams] = None,
               lora_request: Optional[LoRARequest] = None) -> Iterator[str]:
        """Yields text deltas of one completion as they are generated (always whole UTF-8
        characters; text that might begin a stop string is held until it is decided)."""
        text, toks = self._single_prompt(prompt)
        params = sampling_params or SamplingParams()
        if isinstance(params, SamplingParams) and params.ranks_completions:
            raise ValueError("stream() cannot rank completions (best_of > n): the best is known only at the end")
        with self._lock:
            rid = self.engine.add_request(toks, params, prompt=text, lora=self._lora_list(lora_request, 1)[0])
            box = self._mailboxes[rid] = []
        try:
            while True:
                with self._lock:
                    deltas = list(box)
                    box.clear()
                for d in deltas:
                    if d.text(0):
                        yield d.text(0)
                    if d.finished:
                        return
                self._advance(lambda: bool(box))
        finally:
            with self._lock:
                self._mailboxes.pop(rid, None)
                self.engine.abort(rid)

    # ---- incremental serving API ----
    def add_request(self, prompt: Union[Prompt, Sequence[int]], sampling_params: Optional[SamplingParams] = None,
                    request_id: Optional[str] = None, lora_request: Optional[LoRARequest] = None) -> str:
        """Queues a request (a prompt as generate() takes one, or token ids) at any time; returns
        its id. Its progress comes out of step(). ValueError when it could never run (too long,
        bigger than the KV pool)."""
        text, toks = self._single_prompt(prompt)
        with self._lock:
            return self.engine.add_request(toks, sampling_params or SamplingParams(), prompt=text,
                                           request_id=request_id, lora=self._lora_list(lora_request, 1)[0])

    def step(self) -> List[RequestDelta]:
        """Runs one engine step; returns a RequestDelta for each request added with add_request()
        that progressed: new text and token ids per completion, finished / finish_reason, and the
        whole RequestOutput once finished."""
        with self._lock:
            if not self._unclaimed and self.engine.has_unfinished():
                self._advance()
            out, self._unclaimed = self._unclaimed, []
            return out

    def abort(self, request_id: str) -> None:
        """Stops a request wherever it is and frees its KV blocks. Its last delta (finish_reason
        "abort") comes out of the next step() (or ends the generate() / stream() driving it)."""
        with self._lock:
            delta = self.engine.abort(request_id)
            if delta is not None:
                self._mailboxes.get(delta.request_id, self._unclaimed).append(delta)

    def has_unfinished(self) -> bool:
        """Whether any request is still waiting or running (or has progress not yet handed out)."""
        with self._lock:
            return bool(self._unclaimed) or self.engine.has_unfinished()

    def _advance(self, ready: Callable[[], bool] = lambda: False) -> None:
        """One engine step, unless `ready()` holds once this thread has the engine (another
        thread's step may have brought what the caller waits for); each delta goes to the
        mailbox of whoever drives its request."""
        with self._lock:
            if ready():
                return
            if not self.engine.has_unfinished():
                raise RuntimeError("the engine has no unfinished request to advance")
            for d in self.engine.step():
                box = self._mailboxes.get(d.request_id)
                (self._unclaimed if box is None else box).append(d)

    def chat(self, messages, sampling_params: Optional[SamplingParams] = None, *,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: Optional[List[dict]] = None, chat_template_kwargs: Optional[dict] = None,
             use_tqdm: bool = False, lora_request: LoraRequests = None):
        """messages: one conversation (list of {"role", "content"}) or a list of them.
        Returns a RequestOutput, or a list for a list of conversations.

        continue_final_message: the reply continues the last message (e.g. a started assistant
        turn) instead of opening a new one; needs add_generation_prompt=False, as in vLLM.
        tools: tool (function) definitions, JSON schema dicts, for templates that render them."""
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("chat() needs a conversation (a list of messages) or a list of conversations, "
                             f"got {messages!r}")
        single = isinstance(messages[0], dict)
        convs = [messages] if single else list(messages)
        for i, c in enumerate(convs):
            if not isinstance(c, (list, tuple)) or not c:
                raise ValueError(f"conversation {i} has no messages")
        kwargs = dict(chat_template_kwargs or {}, add_generation_prompt=add_generation_prompt,
                      continue_final_message=continue_final_message, tools=tools)
        prompts = [self.tokenizer.apply_chat_template(c, **kwargs) for c in convs]
        outs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)
        return outs[0] if single else outs

    def embed(self, prompts: PromptType, *, pooling: str = "last", normalize: bool = True,
              use_tqdm: bool = False, lora_request: LoraRequests = None) -> List[EmbeddingRequestOutput]:
        """One embedding per prompt (prompts as generate() takes them): the final hidden state
        (after the final norm) of the last prompt token (pooling="last", what a decoder has read
        the whole prompt into), the mean over the prompt's tokens (pooling="mean"), or every
        position's (pooling="all", vLLM's ALL pooling: ``embedding`` is [tokens][hidden]), each
        L2-normalised unless normalize=False. All prompts share forwards, with f32 activations."""
        reqs = self._prepare(prompts, None)
        pooled = [PooledHiddenStates(len(toks), pooling) for _, toks in reqs]
        bar = _progress(len(reqs), "embedding") if use_tqdm else None
        try:
            self._run_scores([toks for _, toks in reqs], [p.rows_from for p in pooled], pooled, embed=True,
                             loras=self._lora_list(lora_request, len(reqs)))
        finally:
            if bar:
                bar.update(len(reqs))
                bar.close()
        return [EmbeddingRequestOutput(str(i), EmbeddingOutput(p.embedding(normalize).tolist()),
                                       [] if isinstance(toks, PromptEmbeds) else toks)
                for i, ((_, toks), p) in enumerate(zip(reqs, pooled))]

    def score(self, token_ids, lora_request: LoraRequests = None) -> np.ndarray:
        """float32 logits [len(token_ids), vocab] at every position (position i predicts i+1).
        A list of token lists gives a list of arrays, the sequences sharing forwards. A prompt of
        embeddings, {"prompt_embeds": array} (enable_prompt_embeds), scores its rows likewise."""
        batch = not isinstance(token_ids, dict) and _is_batch(token_ids)
        seqs = [self._prompt(t)[1] if isinstance(t, dict) else token_ids_of(t)
                for t in (token_ids if batch else [token_ids])]
        vocab = self.runner.config["vocab_size"]
        collectors = [LogitsCollector(len(s), vocab) for s in seqs]
        self._run_scores(seqs, [0] * len(seqs), collectors, loras=self._lora_list(lora_request, len(seqs)))
        out = [c.logits for c in collectors]
        return out if batch else out[0]

    def token_logprobs(self, token_ids, start: Union[int, Sequence[int]] = 1, lora_request: LoraRequests = None
                       ) -> Union[TokenLogprobs, List[TokenLogprobs]]:
        """Teacher-forced log-probability of every token from position `start` on, given the
        tokens before it, and whether it is the greedy (argmax) token there. A list of token
        lists is scored in shared forwards and gives a list (`start`: one int or one per list)."""
        batch = _is_batch(token_ids)
        seqs = [token_ids_of(t) for t in (token_ids if batch else [token_ids])]
        starts = list(start) if isinstance(start, (list, tuple)) else [start] * len(seqs)
        if len(starts) != len(seqs):
            raise ValueError(f"{len(starts)} starts for {len(seqs)} sequences")
        vocab = self.runner.config["vocab_size"]
        for s, st in zip(seqs, starts):
            if len(s) < 2:
                raise ValueError(f"need at least 2 tokens, got {len(s)}")
            if not 0 <= s[-1] < vocab:  # only predicted, never fed: the engine does not see it
                raise ValueError(f"token id {s[-1]} is out of range [0, {vocab})")
            if not isinstance(st, (int, np.integer)) or isinstance(st, bool) or not 1 <= st < len(s):
                raise ValueError(f"start must be an integer in [1, {len(s) - 1}] for {len(s)} tokens, got {st!r}")
        collectors = [LogprobCollector(s, int(st)) for s, st in zip(seqs, starts)]
        # The last token is only ever predicted: the model runs every token before it.
        self._run_scores([s[:-1] for s in seqs], [int(st) - 1 for st in starts], collectors,
                         loras=self._lora_list(lora_request, len(seqs)))
        out = [c.result() for c in collectors]
        return out if batch else out[0]

    def _run_scores(self, feeds: List[Union[List[int], PromptEmbeds]], rows_from: List[int],
                    consumers: List[RowConsumer], embed: bool = False, loras: Optional[list] = None) -> None:
        """Adds a score request (with `embed`, an embedding) per feed and steps the engine until
        all are done (generation requests in flight progress alongside; their deltas go where
        they always go)."""
        seqs = []
        done = lambda: all(self.engine.score_finished(s) for s in seqs)  # noqa: E731
        try:
            with self._lock:
                for feed, first, consume, lora in zip(feeds, rows_from, consumers, loras or [None] * len(feeds)):
                    seqs.append(self.engine.add_score(feed, first, consume, embed=embed, lora=lora))
            while not done():
                self._advance(done)
        finally:
            with self._lock:
                for s in seqs:
                    if not self.engine.score_finished(s):
                        self.engine.abort_score(s)

    def stats(self) -> dict:
        """Running / waiting sequences, KV blocks used / free, prefix-cache hit rate, generated
        tokens per second of busy time (while requests were unfinished), preemptions."""
        with self._lock:
            return self.engine.stats()

    # ---- LoRA adapters ----
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Loads an adapter now (else it loads with its first request); ValueError for a bad file."""
        self._lora_list(lora_request, 1)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """Drops adapter `lora_id` from the cache (requests running with it finish with it); False
        when it is not loaded."""
        with self._lock:
            return self._lora_cache().remove(lora_id)

    def list_loras(self) -> List[int]:
        """The ids of the adapters loaded, least recently used first."""
        with self._lock:
            return self._lora_cache().ids()

    def _lora_cache(self) -> LoraCache:
        if self._loras is None:
            raise ValueError("LoRA adapters need LLM(..., enable_lora=True)")
        return self._loras

    def _lora_list(self, lora_request: LoraRequests, n: int) -> list:
        """(the runner's adapter, the request's scale) for each of n prompts (None: the base
        model), loaded as needed."""
        if lora_request is None:
            return [None] * n
        reqs = [lora_request] * n if isinstance(lora_request, LoRARequest) else list(lora_request)
        if len(reqs) != n:
            raise ValueError(f"{len(reqs)} LoRA requests for {n} prompts")
        if any(r is not None for r in reqs):
            self._lora_cache()
        with self._lock:
            return [None if r is None else (self._loras.get(r), r.scale) for r in reqs]

    # ---- helpers ----
    def _prepare(self, prompts, prompt_token_ids) -> List[tuple]:
        """(text or None, token ids or PromptEmbeds) per prompt."""
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("pass exactly one of prompts or prompt_token_ids")
        if prompts is not None:
            if isinstance(prompts, (str, dict)):
                return [self._prompt(prompts)]
            if not isinstance(prompts, (list, tuple)):
                raise TypeError(f"prompts must be a prompt or a list of prompts ({PROMPT_TYPES}), "
                                f"got {type(prompts).__name__}")
            if not prompts:
                raise ValueError("no prompts given (an empty list)")
            return [self._prompt(p) for p in prompts]
        ids = list(prompt_token_ids)
        if not ids:
            raise ValueError("no prompts given (an empty prompt_token_ids)")
        if ids and isinstance(ids[0], (int, np.integer)):
            ids = [ids]
        return [(None, token_ids_of(toks)) for toks in ids]

    def _prompt(self, prompt) -> tuple:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            unknown = sorted(set(prompt) - {"prompt", "prompt_token_ids", "prompt_embeds"})
            if unknown:
                raise ValueError(f"unsupported prompt keys {unknown}: {PROMPT_TYPES}")
            if "prompt_embeds" in prompt:
                return None, self._prompt_embeds(prompt)
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise TypeError(f"'prompt' must be a str, got {type(text).__name__}")
            if "prompt_token_ids" in prompt:  # the ids are the prompt; any text is what it reads as
                return text, token_ids_of(prompt["prompt_token_ids"])
            if text is not None:
                return text, self.tokenizer.encode(text)
        raise TypeError(f"{PROMPT_TYPES}, got {type(prompt).__name__}" + (
            f" {prompt!r}" if isinstance(prompt, dict) else ""))

    def _prompt_embeds(self, prompt: dict) -> PromptEmbeds:
        if not self.enable_prompt_embeds:
            raise ValueError("prompt_embeds needs LLM(..., enable_prompt_embeds=True)")
        if "prompt_token_ids" in prompt:
            raise ValueError("a prompt gives prompt_embeds or prompt_token_ids, not both")
        return prompt_embeds_of(prompt["prompt_embeds"], self.runner.config["hidden_size"])

    def _single_prompt(self, prompt) -> tuple:
        """A prompt as generate() takes one, or a flat sequence of token ids."""
        if isinstance(prompt, (str, dict)):
            return self._prompt(prompt)
        if not isinstance(prompt, (list, tuple, np.ndarray)):
            raise TypeError(f"{PROMPT_TYPES} or a list of token ids, got {type(prompt).__name__}")
        return None, token_ids_of(prompt)

    @staticmethod
    def _params_list(sampling_params, n):
        if sampling_params is None:
            return [SamplingParams()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n:
            raise ValueError(f"{len(params)} sampling params for {n} prompts")
        return params


def _is_batch(token_ids) -> bool:
    """A list of token lists (not one list of ids, nor a 1-D array)."""
    if isinstance(token_ids, np.ndarray):
        return token_ids.ndim == 2
    return len(token_ids) > 0 and not isinstance(token_ids[0], (int, np.integer))


def _load_tokenizer(path: Path, model_file, override) -> Tokenizer:
    """The tokenizer for the opened model file: `override`, the vocabulary a GGUF embeds (its
    metadata is dropped from the file object here), the llama2.c tokenizer beside the checkpoint,
    or a model directory's. ValueError when it has ids the model has no embedding for (or, for
    llama2.c, not exactly one token per embedding row)."""
    metadata = model_file.pop_tokenizer_metadata()
    exact = False
    if override is not None:
        tokenizer = Tokenizer.from_file(override)
    elif model_file.format == "gguf":
        tokenizer = Tokenizer.from_gguf_metadata(metadata)  # its size was checked with the file
    elif model_file.format == "llama2c":
        # llama2.c keeps the tokenizer beside the checkpoint (tokenizer.bin or tok<N>.bin)
        cand = next((c for c in [path.with_name("tokenizer.bin"), *sorted(path.parent.glob("tok*.bin"))]
                     if c.exists()), None)
        if cand is None:
            raise ValueError(f"no llama2.c tokenizer next to {path}; pass tokenizer=")
        tokenizer, exact = Tokenizer.from_llama2c(cand), True
    else:
        tokenizer = Tokenizer.from_dir(path)
    rows = model_file.vocab_size
    if tokenizer.vocab_size > rows or (exact and tokenizer.vocab_size != rows):
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens, but {path.name}'s embedding has "
                         f"{rows} rows")
    return tokenizer


# Models at least this big show a progress bar while their layers load.
PROGRESS_MIN_BYTES = 256 << 20


@contextlib.contextmanager
def _load_progress(path: Path, file_bytes: int):
    """A layer-count progress callback for the runner (None for small models)."""
    if file_bytes < PROGRESS_MIN_BYTES:
        yield None
        return
    from tqdm import tqdm
    bar = tqdm(desc=f"loading {path.name}", unit="layer", leave=False)

    def update(done, total):
        bar.total = total
        bar.update(done - bar.n)
        if done == total:  # show the finished bar even when updates came faster than tqdm redraws
            bar.refresh()

    try:
        yield update
    finally:
        bar.close()


def _progress(total, desc="generating"):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="req")
