"""Teacher-forced forwards over many token sequences at once, for scoring and evaluation.

Several sequences share each forward, up to the engine's token budget, so a thousand short
(context, continuation) pairs cost a few large forwards instead of a thousand small ones.
Cached prefix blocks are adopted, so shared contexts are computed once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

import numpy as np


@dataclass
class TokenLogprobs:
    """Log-probabilities of ``token_ids[i]`` given every token before it in the scored sequence.

    ``token_ids``, ``logprobs`` (float32) and ``greedy`` (bool: the model's argmax at that
    position, i.e. what greedy decoding would have produced) are aligned; ``start`` is the
    position in the scored sequence of ``token_ids[0]``.
    """
    start: int
    token_ids: np.ndarray
    logprobs: np.ndarray
    greedy: np.ndarray

    @property
    def total(self) -> float:
        return float(self.logprobs.sum(dtype=np.float64))


@dataclass
class _Job:
    index: int
    feed: List[int]      # tokens run through the model
    first_row: int       # first position whose logits are wanted
    seq: Optional[int] = None
    fed: int = 0         # tokens of `feed` whose K/V are in the cache


def forward_many(runner, token_budget: int, feeds: Sequence[List[int]], first_rows: Sequence[int],
                 consume: Callable[[int, int, np.ndarray], None]) -> None:
    """Runs every `feeds[i]` through the model and calls ``consume(i, pos, logits)`` with the
    logits rows of positions ``pos .. pos + len(logits) - 1`` (all >= ``first_rows[i]``), in
    order, possibly in several pieces. Sequences are admitted while the KV pool has room for
    them whole, so a step never runs out of blocks, and at most `token_budget` at a time (more
    could not all advance in one step)."""
    total_blocks = runner.stats()["kv_blocks_total"]
    jobs = []
    for i, (feed, first) in enumerate(zip(feeds, first_rows)):
        if runner.blocks_for(len(feed)) > total_blocks:
            raise ValueError(f"a sequence of {len(feed)} tokens can never fit in the KV cache "
                             f"({total_blocks * runner.block_size} tokens)")
        jobs.append(_Job(i, list(feed), int(first)))
    pending, active = list(reversed(jobs)), []
    try:
        while pending or active:
            _admit(runner, pending, active, token_budget)
            items, chunks = [], []
            budget = token_budget
            for job in active:
                if budget == 0:
                    break
                # Chunks are as long as the budget allows, not cut at first_row: many-token steps
                # run with f32 activations (tiny ones quantize them to 8 bits on the CPU), so a
                # sequence is scored alike whatever shares its steps. Rows before first_row
                # are computed and dropped; a chunk entirely before it asks for none.
                take = min(len(job.feed) - job.fed, budget)
                mode = "all" if job.fed + take > job.first_row else "none"
                items.append((job.seq, job.feed[job.fed:job.fed + take], mode))
                chunks.append((job, take, mode))
                budget -= take
            logits = runner.step(items)
            row = 0
            for job, take, mode in chunks:
                if mode == "all":
                    skip = max(0, job.first_row - job.fed)
                    consume(job.index, job.fed + skip, logits[row + skip:row + take])
                    row += take
                job.fed += take
                if job.fed == len(job.feed):
                    runner.release_sequence(job.seq)
                    job.seq = None
                    active.remove(job)
    finally:
        for job in active:
            if job.seq is not None:
                runner.release_sequence(job.seq)


def _admit(runner, pending: List[_Job], active: List[_Job], max_seqs: int) -> None:
    """Starts waiting jobs while the free blocks cover every started job's remaining growth."""
    free = runner.stats()["kv_blocks_free"]
    free -= sum(runner.blocks_for(len(j.feed)) - runner.blocks_for(j.fed) for j in active)
    while pending and len(active) < max_seqs:
        job = pending[-1]
        if runner.blocks_for(len(job.feed)) > free and active:
            return
        job.seq = runner.add_sequence()
        # Only positions before first_row may come from the cache: their logits are not wanted.
        job.fed = runner.adopt_prefix(job.seq, job.feed[:job.first_row + 1])
        free = runner.stats()["kv_blocks_free"]
        free -= sum(runner.blocks_for(len(j.feed)) - runner.blocks_for(j.fed) for j in active)
        free -= runner.blocks_for(len(job.feed)) - runner.blocks_for(job.fed)
        pending.pop()
        active.append(job)


def token_logprobs(runner, token_budget: int, sequences: Sequence[List[int]],
                   starts: Sequence[int]) -> List[TokenLogprobs]:
    """The log-probability of ``sequences[i][p]`` for every p >= ``starts[i]``."""
    pieces: List[list] = [[] for _ in sequences]

    def consume(i: int, pos: int, logits: np.ndarray) -> None:
        targets = np.asarray(sequences[i][pos + 1:pos + 1 + len(logits)], dtype=np.int64)
        top = logits.max(axis=1)
        # float64 sum over the vocabulary: a float32 one loses digits a perplexity needs.
        log_norm = top + np.log(np.exp(logits - top[:, None]).sum(axis=1, dtype=np.float64))
        picked = logits[np.arange(len(targets)), targets]
        pieces[i].append(((picked - log_norm).astype(np.float32), logits.argmax(axis=1) == targets))

    forward_many(runner, token_budget, [s[:-1] for s in sequences], [st - 1 for st in starts], consume)
    out = []
    for seq, start, parts in zip(sequences, starts, pieces):
        out.append(TokenLogprobs(start, np.asarray(seq[start:], dtype=np.int64),
                                 np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])))
    return out
