"""Speculative decoding: proposals the target model verifies several at a time.

A proposer suggests up to k tokens to follow a generation's last token; the engine's next step
computes that token and the proposals in one forward (each proposal's row comes back after the
row sampled from), and sampling accepts a prefix of them as the target itself would produce
them: at temperature 0 while they equal its greedy tokens, else by rejection sampling (accept x
with probability min(1, p(x) / q(x)); on rejection, draw from norm(max(0, p - q))), so outputs
follow the target's distribution exactly. The engine drops rejected tokens' K/V.

Proposers: prompt lookup (n-grams of the prompt and the output so far; no model) and a draft
model sharing the tokenizer, run by a second engine with its own KV cache, whose sequences
follow their targets'. The number of proposals adapts per sequence to what it accepts.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np


@dataclass
class SpeculativeConfig:
    """vLLM's ``speculative_config``: ``{"method": "ngram", "num_speculative_tokens": 5,
    "prompt_lookup_max": 4, "prompt_lookup_min": 2}`` or ``{"model": DRAFT_PATH,
    "num_speculative_tokens": 5}`` (method "draft_model")."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: Optional[str] = None

    @classmethod
    def parse(cls, config: Union[None, str, dict, "SpeculativeConfig"]) -> Optional["SpeculativeConfig"]:
        """From a dict, a JSON string (the CLI's) or a SpeculativeConfig; None stays None."""
        if config is None or isinstance(config, SpeculativeConfig):
            return config
        if isinstance(config, str):
            try:
                config = json.loads(config)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(config, dict):
            raise TypeError(f"speculative_config must be a dict, got {type(config).__name__}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model"}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}")
        method = config.get("method", "draft_model" if config.get("model") else None)
        if method not in ("ngram", "draft_model"):
            raise ValueError(f"speculative_config: method must be 'ngram' or 'draft_model' (or give 'model'), "
                             f"got {method!r}")
        if method == "draft_model" and not config.get("model"):
            raise ValueError("speculative_config: a draft model needs 'model' (a path or hub id)")
        out = cls(method, config.get("num_speculative_tokens"), config.get("prompt_lookup_max", 4),
                  config.get("prompt_lookup_min", 2), config.get("model"))
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            v = getattr(out, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {v!r}")
        if out.prompt_lookup_min > out.prompt_lookup_max:
            raise ValueError("speculative_config: prompt_lookup_min exceeds prompt_lookup_max")
        return out


@dataclass
class Speculation:
    """One completion's speculation state."""
    k: int                                    # proposals to ask for next
    draft: List[int] = field(default_factory=list)  # proposed after the last token, being verified
    q: Optional[np.ndarray] = None            # the draft model's distributions of `draft` (None: point masses)
    lookup: Optional["NgramIndex"] = None     # prompt lookup's index of the completion's tokens (method "ngram")

    def adapt(self, verified: int, accepted: int, most: int) -> None:
        """One more after a run of acceptances, one past the accepted run after a rejection."""
        if verified == 0:
            return
        self.k = min(most, self.k + 1) if accepted == verified else max(1, accepted + 1)


class NgramIndex:
    """Prompt lookup over a growing sequence (the prompt, then the output so far): proposes the
    k tokens that followed the latest earlier occurrence of the longest suffix of lookup_max
    down to lookup_min tokens. Every n-gram's latest end is kept as tokens arrive, so a proposal
    costs the same at any context length."""

    def __init__(self, lookup_min: int, lookup_max: int):
        self.lookup_min, self.lookup_max = lookup_min, lookup_max
        self.tokens: List[int] = []
        self._latest: Dict[tuple, int] = {}  # n-gram -> where its latest occurrence ends
        self._indexed = 0  # the n-grams ending before this position are in _latest

    def follow(self, prompt: List[int], output: List[int]) -> None:
        """Takes in what is new of prompt + output (which only ever grow)."""
        if not self.tokens:
            self.tokens.extend(prompt)
        self.tokens.extend(output[len(self.tokens) - len(prompt):])

    def propose(self, k: int) -> List[int]:
        """Up to k tokens; [] when no suffix of lookup_min tokens or more occurred before."""
        tokens, n = self.tokens, len(self.tokens)
        # The n-grams ending before the last token (an occurrence of the suffix is earlier than
        # it), in order of their ends, so each keeps its latest.
        for length in range(self.lookup_min, self.lookup_max + 1):
            first = max(self._indexed, length - 1)
            grams = zip(*(tokens[first + 1 - length + i:n - length + i] for i in range(length)))
            self._latest.update(zip(grams, range(first, n - 1)))
        self._indexed = max(self._indexed, n - 1)
        for length in range(min(self.lookup_max, n - 1), self.lookup_min - 1, -1):
            end = self._latest.get(tuple(tokens[n - length:]))
            if end is not None:
                return tokens[end + 1:end + 1 + k]
        return []


class DraftModel:
    """A draft model run by an engine of its own (its own KV pool), with one sequence per target
    completion that follows the target's tokens: rewound to what the target accepted, then
    extended by greedy or sampled proposals."""

    def __init__(self, path: str, target_runner, device: str, num_threads: int, max_num_seqs: int,
                 max_num_batched_tokens: int):
        from . import _core
        from .models import resolve_model
        self.runner = _core.ModelRunner(
            str(resolve_model(path)), device=device, num_threads=num_threads,
            max_model_len=target_runner.max_model_len,
            kv_cache_tokens=max(target_runner.stats()["kv_blocks_total"] * target_runner.block_size, 16))
        vocab, target_vocab = self.runner.config["vocab_size"], target_runner.config["vocab_size"]
        if vocab != target_vocab:
            raise ValueError(f"the draft model's vocabulary ({vocab} tokens) is not the target's ({target_vocab}): "
                             "a draft model must share the target's tokenizer")
        self.engine = _core.Engine(self.runner, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens)
        self._seqs: Dict[int, Tuple[int, List[int]]] = {}  # target seq -> (draft seq, its tokens)
        self._targets: Dict[int, int] = {}  # draft seq -> target seq

    def release(self, target_seq: int) -> None:
        entry = self._seqs.pop(target_seq, None)
        if entry is not None:
            self._targets.pop(entry[0], None)
            self.engine.abort(entry[0])

    def propose(self, wants: Sequence[Tuple[int, List[int], int]], sample) -> Dict[int, Tuple[List[int], list]]:
        """wants: (target seq, its tokens, k). Returns target seq -> (proposals, [row or None]),
        the rows being the draft's logits each proposal was drawn from. `sample(target_seq,
        logits_rows) -> (tokens, distributions or None)` draws from the draft's rows."""
        by_draft = {}
        for target_seq, tokens, k in wants:
            self._follow(target_seq, tokens)
            by_draft[self._seqs[target_seq][0]] = (target_seq, k)
        result = {t: ([], []) for t, _, _ in wants}
        for _ in range(max(k for _, _, k in wants)):
            if not self.engine.has_unfinished():
                break
            out = self.engine.step()
            for draft_seq in out["ended"]:  # the draft's pool is full: it proposes no more
                self._forget(draft_seq)
                by_draft.pop(draft_seq, None)
            rows = [int(i) for i in out["sample_rows"] if int(out["seqs"][i]) in by_draft]
            if not rows:
                continue
            targets = [by_draft[int(out["seqs"][i])][0] for i in rows]
            tokens, dists = sample(targets, out["logits"][np.asarray(rows)])
            go_on = []
            for r, target_seq, tok, dist in zip(rows, targets, tokens, dists):
                proposals, qs = result[target_seq]
                proposals.append(int(tok))
                qs.append(dist)
                draft_seq = int(out["seqs"][r])
                if len(proposals) < by_draft[draft_seq][1]:
                    go_on.append((draft_seq, int(tok)))
                    self._seqs[target_seq][1].append(int(tok))
                else:
                    del by_draft[draft_seq]  # it waits, its last proposal uncomputed
            if go_on:
                ended = self.engine.commit([s for s, _ in go_on], [t for _, t in go_on], [False] * len(go_on))
                for draft_seq in ended:  # its context is full: it proposes no more
                    self._forget(draft_seq)
                    by_draft.pop(draft_seq, None)
            if not by_draft:
                break
        return result

    def _forget(self, draft_seq: int) -> None:
        target = self._targets.pop(draft_seq, None)
        if target is not None:
            self._seqs.pop(target, None)

    def _follow(self, target_seq: int, tokens: List[int]) -> None:
        """Brings the draft's sequence to the target's tokens (its last one still to compute)."""
        entry = self._seqs.get(target_seq)
        if entry is None:
            seq = self.engine.add_sequence(tokens)
            self._seqs[target_seq] = (seq, list(tokens))
            self._targets[seq] = target_seq
            return
        seq, held = entry
        common = 0
        for a, b in zip(held, tokens):
            if a != b:
                break
            common += 1
        common = min(common, len(tokens) - 1)  # the last token is recomputed for its row
        self.engine.rewind(seq, common, tokens[common:])
        self._seqs[target_seq] = (seq, list(tokens))
