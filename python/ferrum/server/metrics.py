"""Prometheus metrics of one server (its own registry, so several servers share a process):
the engine's state read at each scrape, and counters and latency histograms that requests feed
as they progress. Names follow vLLM's, under ``ferrum:``."""
from __future__ import annotations

import time
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

from ..structured import MASK_COST

disable_created_metrics()  # no *_created series beside each counter and histogram (vLLM's choice too)

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


class ServerMetrics:
    """per_adapter: also count requests and tokens by the adapter they ran with (label
    ``lora_name``; the base model's requests under the model's own name), as LoRA servers do."""

    def __init__(self, model_name: str, per_adapter: bool = False):
        self.registry = r = CollectorRegistry()
        labels = {"model_name": model_name}
        self.running = Gauge("ferrum:num_requests_running", "Sequences in the running batch.", registry=r)
        self.waiting = Gauge("ferrum:num_requests_waiting", "Requests and sequences waiting to run.", registry=r)
        self.kv_usage = Gauge("ferrum:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", registry=r)
        self.prefix_hit_rate = Gauge("ferrum:prefix_cache_hit_rate",
                                     "Prompt tokens found in the prefix cache / prompt tokens looked up.", registry=r)
        self.mask_steps = Gauge("ferrum:structured_output_mask_steps",
                                "Structured-output token masks computed.", registry=r)
        self.mask_seconds = Gauge("ferrum:structured_output_mask_seconds",
                                  "Seconds spent computing and applying structured-output masks.", registry=r)
        self.prompt_tokens = Counter("ferrum:prompt_tokens", "Prompt tokens of admitted requests.",
                                     labels.keys(), registry=r).labels(**labels)
        self.generation_tokens = Counter("ferrum:generation_tokens", "Generated tokens.",
                                         labels.keys(), registry=r).labels(**labels)
        self.finished = Counter("ferrum:request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=r)
        self.ttft = Histogram("ferrum:time_to_first_token_seconds", "Time to first token.",
                              labels.keys(), buckets=TTFT_BUCKETS, registry=r).labels(**labels)
        self.itl = Histogram("ferrum:inter_token_latency_seconds", "Time between consecutive tokens.",
                             labels.keys(), buckets=ITL_BUCKETS, registry=r).labels(**labels)
        self.e2e = Histogram("ferrum:e2e_request_latency_seconds", "Request latency, arrival to last token.",
                             labels.keys(), buckets=E2E_BUCKETS, registry=r).labels(**labels)
        self.model_name = model_name
        self.by_adapter = None
        if per_adapter:
            names = ["model_name", "lora_name"]
            self.by_adapter = (
                Counter("ferrum:lora_requests", "Requests by the LoRA adapter they ran with.", names, registry=r),
                Counter("ferrum:lora_prompt_tokens", "Prompt tokens by LoRA adapter.", names, registry=r),
                Counter("ferrum:lora_generation_tokens", "Generated tokens by LoRA adapter.", names, registry=r))

    def scrape(self, stats: dict) -> bytes:
        """The exposition text, the gauges first set from the engine's ``stats``."""
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting_requests"])
        total = stats["kv_blocks_total"]
        self.kv_usage.set(stats["kv_blocks_used"] / total if total else 0.0)
        self.prefix_hit_rate.set(stats["prefix_cache_hit_rate"])
        cost = MASK_COST.snapshot()
        self.mask_steps.set(cost["steps"])
        self.mask_seconds.set(cost["seconds"])
        return generate_latest(self.registry)

    def request(self, prompt_tokens: int, lora_name: str) -> "RequestTimer":
        """A request's timer; lora_name: its adapter's, or the model's for the base."""
        self.prompt_tokens.inc(prompt_tokens)
        generated = None
        if self.by_adapter:
            requests, prompt, generated = (c.labels(self.model_name, lora_name) for c in self.by_adapter)
            requests.inc()
            prompt.inc(prompt_tokens)
        return RequestTimer(self, generated)


class RequestTimer:
    """One request's latencies: time to its first token, between tokens, to its end."""

    def __init__(self, metrics: ServerMetrics, adapter_tokens: Optional[Counter] = None):
        self.metrics = metrics
        self.adapter_tokens = adapter_tokens  # the generated tokens of the request's adapter
        self.arrival = self.last = time.perf_counter()
        self.first: Optional[float] = None

    def tokens(self, count: int, in_sequence: int = 1) -> None:
        """``count`` tokens arrived (one delta's, over the request's completions), at most
        ``in_sequence`` of them one completion's: a delta that merges several steps, or holds
        accepted proposals, counts each at an even share of the gap since the last."""
        if count <= 0:
            return
        now = time.perf_counter()
        if self.first is None:
            self.first = now
            self.metrics.ttft.observe(now - self.arrival)
        else:
            for _ in range(in_sequence):
                self.metrics.itl.observe((now - self.last) / in_sequence)
        self.last = now
        self.metrics.generation_tokens.inc(count)
        if self.adapter_tokens is not None:
            self.adapter_tokens.inc(count)

    def finished(self, reasons) -> None:
        self.metrics.e2e.observe(time.perf_counter() - self.arrival)
        for reason in reasons:
            self.metrics.finished.labels(self.metrics.model_name, reason or "abort").inc()
