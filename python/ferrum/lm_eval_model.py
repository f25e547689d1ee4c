"""lm-evaluation-harness model ``ferrum``: its tasks run through ferrum's batched scoring and
generation, with ``ferrum.eval``'s definitions.

    lm_eval --model ferrum --model_args pretrained=PATH,device=cpu --tasks TASK

``pretrained`` is anything ``ferrum.LLM`` loads (a path, a hub id; none: the default model);
``device`` (default cpu), ``kv_dtype``, ``num_threads``, ``max_model_len`` and ``max_gen_toks``
(default 256) may be given too. lm_eval's own ``--device`` counts only when it names a ferrum
device (its default, cuda:0, is not one). Every request of a kind goes to the engine at once, so
``--batch_size`` changes nothing. Needs the ``eval`` extra (``pip install ferrum[eval]``);
``import ferrum`` never imports lm_eval.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import lm_eval.models  # noqa: F401  lm_eval lists its own models only while its registry is empty
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import simple_parse_args_string

from . import eval as ferrum_eval
from .llm import LLM
from .sampling import SamplingParams


@register_model("ferrum")
class FerrumLM(LM):
    def __init__(self, pretrained: Optional[str] = None, device: str = "cpu", kv_dtype: str = "f16",
                 num_threads: Optional[int] = None, max_model_len: Optional[int] = None,
                 max_gen_toks: int = 256, batch_size=None, max_batch_size=None, llm: Optional[LLM] = None):
        super().__init__()
        self.llm = llm if llm is not None else LLM(
            pretrained, device=device, kv_dtype=kv_dtype,
            num_threads=None if num_threads is None else int(num_threads),
            max_model_len=None if max_model_len is None else int(max_model_len))
        self.max_gen_toks = int(max_gen_toks)
        tok = self.llm.tokenizer
        # What an empty context (and each rolling text) is conditioned on, as lm_eval's models do.
        self.prefix_token_id = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: Optional[dict] = None) -> "FerrumLM":
        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: Optional[dict] = None) -> "FerrumLM":
        """--model_args, over what lm_eval adds (batch sizes, and --device when ferrum runs it)."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        device = extra.pop("device", None)
        if isinstance(device, str) and device.split(":")[0] in ("cpu", "opencl"):
            extra["device"] = device
        return cls(**{**extra, **arg_dict})

    @property
    def max_length(self) -> int:
        return self.llm.runner.max_model_len

    # ---- lm_eval's three request kinds ----
    def loglikelihood(self, requests) -> List[Tuple[float, bool]]:
        """log P(continuation | context) and whether greedy decoding produces it
        (``ferrum.eval.loglikelihood``); an empty context is the prefix token."""
        pairs = [self._pair(*req.args) for req in requests]
        if not pairs:
            return []
        return [(r.logprob, r.is_greedy) for r in ferrum_eval.loglikelihood(self.llm, pairs)]

    def _pair(self, context: str, continuation: str):
        if context:
            return context, continuation
        return [self.prefix_token_id], self.llm.tokenizer.encode(continuation, add_special_tokens=False)

    def loglikelihood_rolling(self, requests) -> List[float]:
        """Each text's whole log-likelihood after the prefix token, ``-ferrum.eval.perplexity(...).nll``:
        windows of the model's context length, each with half a window of context past the first,
        a text's windows scored together."""
        texts = [self._rolling_ids(req.args[0]) for req in requests]
        return [-ferrum_eval.perplexity(self.llm, ids, window=self.max_length).nll if len(ids) > 1 else 0.0
                for ids in texts]

    def _rolling_ids(self, text: str) -> List[int]:
        return [self.prefix_token_id] + self.llm.tokenizer.encode(text, add_special_tokens=False)

    def generate_until(self, requests) -> List[str]:
        """Greedy (or, with do_sample, sampled) text up to the first of ``until``, all requests
        generated together; a context too long for ``max_gen_toks`` more tokens keeps its end."""
        prompts, params = [], []
        for context, gen_kwargs in (req.args for req in requests):
            p = self._sampling_params(dict(gen_kwargs or {}))
            ids = self.llm.tokenizer.encode(context)
            room = self.max_length - p.max_tokens
            prompts.append(context if len(ids) <= room else {"prompt": context, "prompt_token_ids": ids[-room:]})
            params.append(p)
        if not prompts:
            return []
        return [out.outputs[0].text for out in self.llm.generate(prompts, params)]

    def _sampling_params(self, gen_kwargs: dict) -> SamplingParams:
        until = gen_kwargs.pop("until", None)
        until = [until] if isinstance(until, str) else list(until or [])
        do_sample = gen_kwargs.pop("do_sample", False)
        temperature = float(gen_kwargs.pop("temperature", 0.0)) if do_sample else 0.0
        return SamplingParams(max_tokens=int(gen_kwargs.pop("max_gen_toks", self.max_gen_toks)),
                              temperature=temperature, top_p=float(gen_kwargs.pop("top_p", 1.0) or 1.0),
                              top_k=int(gen_kwargs.pop("top_k", 0) or 0), stop=[u for u in until if u] or None)

    # ---- chat templates (lm_eval --apply_chat_template) ----
    @property
    def tokenizer_name(self) -> str:
        return str(self.llm.model_path)

    def chat_template(self, chat_template=False) -> Optional[str]:
        return self.llm.tokenizer.chat_template

    def apply_chat_template(self, chat_history, add_generation_prompt: bool = True) -> str:
        return self.llm.tokenizer.apply_chat_template(chat_history, add_generation_prompt=add_generation_prompt)
