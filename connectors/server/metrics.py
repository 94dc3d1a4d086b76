"""Prometheus metrics of one server: time to first token, token throughput, KV hits per tier, queue,
session reuse (turns by the tier their history came from, tokens reused), relay (registered
system prompts, tokens they served), preemptions and the KV cache's use (a cache too small for the load).

Each app gets its own registry, so several servers (tests, benchmarks) can live in one process.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .backend import CacheUsage, Delta

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
RATE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
T = TypeVar("T")


class ServerMetrics:
    def __init__(self, queue_depth: Callable[[], int], running: Callable[[], int],
                 relay_prompts: Callable[[], int], cache_usage: Callable[[], CacheUsage] | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("ragfuse_requests", "finished generation requests", ["endpoint", "outcome"],
                                registry=r)
        self.ttft = Histogram("ragfuse_time_to_first_token_seconds", "request arrival to first generated token",
                              ["endpoint"], buckets=TTFT_BUCKETS, registry=r)
        self.tokens = Counter("ragfuse_generated_tokens", "tokens generated (rate() gives tokens/s)", registry=r)
        self.prompt_tokens = Counter("ragfuse_prompt_tokens", "prompt tokens processed", registry=r)
        self.decode_rate = Histogram("ragfuse_decode_tokens_per_second", "one request's tokens/s after its first",
                                     buckets=RATE_BUCKETS, registry=r)
        self.kv_hits = Counter("ragfuse_kv_cache_hits", "RAG prompt pieces whose KV came from a tier", ["tier"],
                               registry=r)
        self.kv_misses = Counter("ragfuse_kv_cache_misses", "RAG prompt pieces whose KV had to be computed",
                                 registry=r)
        self.session_turns = Counter("ragfuse_session_turns", "session turns by where their history KV came "
                                     "from (cpu, disk; none: new or recomputed)", ["tier"], registry=r)
        self.session_tokens = Counter("ragfuse_session_reused_tokens", "history tokens whose KV a session turn "
                                      "reused instead of computing", registry=r)
        self.relay_requests = Counter("ragfuse_relay_requests", "requests served behind a relay system prompt",
                                      registry=r)
        self.relay_tokens = Counter("ragfuse_relay_system_tokens", "system prompt tokens relay served without "
                                    "computing or storing them per request", registry=r)
        self.preemptions = Counter("ragfuse_preemptions", "times a finished request had its KV cache blocks taken "
                                   "for others: swapped (its fused or session KV kept in host memory) or "
                                   "recomputed (ragfuse engine only)", ["kind"], registry=r)
        Gauge("ragfuse_relay_system_prompts", "system prompts registered for relay", registry=r).set_function(
            relay_prompts)
        Gauge("ragfuse_queue_depth", "requests waiting for their first step", registry=r).set_function(queue_depth)
        Gauge("ragfuse_running_requests", "requests being decoded", registry=r).set_function(running)
        if cache_usage is not None:  # the ragfuse engine's; vLLM reports its own
            Gauge("ragfuse_kv_cache_usage_ratio", "share of the KV cache's blocks held by requests and registered "
                  "system prompts (near 1 with preemptions rising: the cache is too small for the load)",
                  registry=r).set_function(lambda: (u := cache_usage()).blocks_used / u.blocks_total)
            Gauge("ragfuse_swap_space_bytes", "host memory holding preempted requests' swapped KV",
                  registry=r).set_function(lambda: cache_usage().swap_bytes)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def record_kv(self, tiers: list[str]) -> None:
        for tier in tiers:
            if tier == "computed":
                self.kv_misses.inc()
            else:
                self.kv_hits.labels(tier).inc()

    def record_request(self, last: Delta) -> None:
        """A finished request's session and relay reuse (its last delta's ``reuse``) and preemptions."""
        reuse = last.reuse or {}
        if "session_id" in reuse:
            self.session_turns.labels(reuse.get("session_tier") or "none").inc()
            self.session_tokens.inc(int(reuse.get("session_tokens_reused", 0)))
        if reuse.get("relay_system_tokens"):
            self.relay_requests.inc()
            self.relay_tokens.inc(int(reuse["relay_system_tokens"]))
        self.preemptions.labels("swapped").inc(last.swapped)
        self.preemptions.labels("recomputed").inc(last.preemptions - last.swapped)

    async def metered(self, items: AsyncIterator[T], endpoint: str, t0: float) -> AsyncIterator[T]:
        """Pass ``items`` through, timing the first token and counting tokens of its ``Delta`` items
        (others, such as a RAG report, pass untouched); ``t0`` is the request's arrival."""
        first: float | None = None
        last: Delta | None = None
        outcome = "cancelled"
        try:
            async with aclosing(items):
                async for d in items:
                    if isinstance(d, Delta):
                        if first is None:
                            first = time.perf_counter()
                            self.ttft.labels(endpoint).observe(first - t0)
                        last = d
                    yield d
            outcome = "ok"
        except Exception:
            outcome = "error"
            raise
        finally:
            self.requests.labels(endpoint, outcome).inc()
            if last is not None:
                self.record_request(last)
                self.tokens.inc(last.completion_tokens)
                self.prompt_tokens.inc(last.prompt_tokens)
                span = time.perf_counter() - (first or t0)
                if last.completion_tokens > 1 and span > 0:
                    self.decode_rate.observe((last.completion_tokens - 1) / span)
