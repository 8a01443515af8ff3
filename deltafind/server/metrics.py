"""GET /metrics: the owners' status snapshots, exposed through prometheus-client.

Request counters live here (`ServerMetrics`); the engine's figures come from its
client's `status().snapshot()` and the store's from the daemon's `store_snapshot()`
callable, so this module knows neither the scheduler's internals nor the store.
One collector maps each snapshot key to a metric family; prometheus-client writes
the exposition text.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

from deltafind.engine.stats import HISTOGRAMS

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")
CONTENT_TYPE = CONTENT_TYPE_LATEST
ENGINE_GAUGES = {  # snapshot key -> (metric, help)
    "waiting": ("deltafind_queue_waiting", "Requests waiting for a free slot."),
    "running": ("deltafind_sequences_running", "Sequences generating now."),
    "draining": ("deltafind_draining", "1 while the server refuses new requests."),
    "tok_s": ("deltafind_decode_tokens_per_second", "Tokens generated per second over the last 10 s."),
    "prefix_bytes": ("deltafind_prefix_cache_bytes", "Bytes held by the prefix cache."),
}
ENGINE_COUNTERS = {
    "steps": ("deltafind_engine_steps", "Forward steps run."),
    "prompt_tokens": ("deltafind_prompt_tokens", "Prompt tokens run through the model."),
    "generated_tokens": ("deltafind_generated_tokens", "Tokens generated."),
    "prefix_hits": ("deltafind_prefix_cache_hits", "Prompts that reused a cached prefix."),
    "step_errors": ("deltafind_engine_step_errors", "Forward steps that failed (their sequences ended with an error)."),
}
STORE_GAUGES = {
    "cache_hit_rate": ("deltafind_expert_cache_hit_ratio", "Share of expert fetches served from memory."),
    "cache_used_bytes": ("deltafind_expert_cache_bytes", "Bytes of experts held in the cache."),
    "prefetch_recall": ("deltafind_prefetch_recall", "Share of routed experts that prefetch predicted."),
}


class ServerMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = defaultdict(int)
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def count_request(self, path: str, status: str) -> None:
        endpoint = path if path in ENDPOINTS else "other"
        with self._lock:
            self.requests[(endpoint, status.split(" ", 1)[0])] += 1

    def count_prompt(self, n: int) -> None:
        with self._lock:
            self.prompt_tokens += n

    def count_completion(self, n: int) -> None:
        with self._lock:
            self.completion_tokens += n

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"requests": dict(self.requests), "prompt_tokens": self.prompt_tokens,
                    "completion_tokens": self.completion_tokens}


class SnapshotCollector(Collector):
    """One scrape's snapshots (server, ready flag, engine, store) as metric families."""

    def __init__(self, server: dict[str, Any], ready: bool, engine: dict[str, Any] | None, store: dict[str, Any] | None) -> None:
        self.server, self.ready, self.engine, self.store = server, ready, engine, store

    def collect(self) -> Iterator[Metric]:
        s = self.server
        reqs = CounterMetricFamily("deltafind_http_requests", "HTTP requests by endpoint and status.", labels=["endpoint", "status"])
        for (endpoint, status), n in sorted(s["requests"].items()):
            reqs.add_metric([endpoint, status], n)
        yield reqs
        yield CounterMetricFamily("deltafind_request_prompt_tokens", "Prompt tokens of accepted requests.", s["prompt_tokens"])
        yield CounterMetricFamily("deltafind_request_completion_tokens", "Completion tokens sent to clients.", s["completion_tokens"])
        yield GaugeMetricFamily("deltafind_ready", "1 once the model is loaded and warmed up.", float(self.ready))
        if self.engine is not None:
            yield from engine_families(self.engine)
        if self.store:
            yield from store_families(self.store)


def engine_families(e: dict[str, Any]) -> Iterator[Metric]:
    for key, (name, help_) in ENGINE_GAUGES.items():
        yield GaugeMetricFamily(name, help_, float(e[key]))
    for key, (name, help_) in ENGINE_COUNTERS.items():
        yield CounterMetricFamily(name, help_, e.get(key, 0))
    finished = CounterMetricFamily("deltafind_sequences_finished", "Sequences ended, by reason.", labels=["reason"])
    for reason, n in sorted(e["finished"].items()):
        finished.add_metric([reason], n)
    yield finished
    for key, (_, help_) in HISTOGRAMS.items():
        h = e["histograms"][key]
        cumulative, buckets = 0, []
        for le, n in zip([*h["buckets"], float("inf")], h["counts"], strict=True):
            cumulative += n
            buckets.append(("+Inf" if le == float("inf") else repr(le), cumulative))
        yield HistogramMetricFamily(f"deltafind_{key}", help_, buckets=buckets, sum_value=h["sum"])
    d, src = e["draft"], [e.get("draft_source") or e["draft"]["source"] or "none"]
    tokens = CounterMetricFamily("deltafind_draft_tokens", "Draft tokens, proposed and accepted by the target.",
                                 labels=["source", "outcome"])
    tokens.add_metric([*src, "proposed"], d["proposed"])
    tokens.add_metric([*src, "accepted"], d["accepted"])
    yield tokens
    for name, kind, help_, value in [
        ("deltafind_draft_acceptance_ratio", GaugeMetricFamily, "Share of proposed draft tokens the target accepted.",
         d["acceptance_rate"]),
        ("deltafind_draft_verify_passes", CounterMetricFamily, "Target passes that verified a draft.", d["steps"]),
        ("deltafind_draft_saved_seconds", GaugeMetricFamily, "Estimated decode time drafting saved (negative: lost): "
         "emitted tokens x target-only step time - drafting step time.", d["saved_s"]),
        ("deltafind_draft_failures", CounterMetricFamily, "Draft failures that fell back to target-only.", d["failures"]),
    ]:
        family = kind(name, help_, labels=["source"])
        family.add_metric(src, value)
        yield family


def store_families(st: dict[str, Any]) -> Iterator[Metric]:
    yield CounterMetricFamily("deltafind_expert_requests", "Expert fetches asked by the model.", st["cache_requested"])
    hits = CounterMetricFamily("deltafind_expert_cache_hits", "Expert fetches served from memory, by tier.", labels=["tier"])
    hits.add_metric(["cache"], st["cache_hits"])
    hits.add_metric(["pinned"], st["pinned_hits"])
    yield hits
    for key, (name, help_) in STORE_GAUGES.items():
        yield GaugeMetricFamily(name, help_, float(st[key]))
    reads = CounterMetricFamily("deltafind_drive_read_bytes", "Bytes read per drive.", labels=["drive"])
    healthy = GaugeMetricFamily("deltafind_drive_healthy", "1 when the drive's pack is readable.", labels=["drive"])
    for d in st["drives"]:
        reads.add_metric([str(d["index"])], d["bytes_read"])
        healthy.add_metric([str(d["index"])], float(d["healthy"]))
    yield reads
    yield healthy
    prefetch = CounterMetricFamily("deltafind_prefetch_reads", "Prefetch reads, by outcome.", labels=["outcome"])
    for outcome in ("issued", "used", "wasted"):
        prefetch.add_metric([outcome], st[f"prefetch_{outcome}"])
    yield prefetch


def render(server: dict[str, Any], ready: bool = False, engine: dict[str, Any] | None = None,
           store: dict[str, Any] | None = None) -> str:
    """The Prometheus text exposition of one scrape's snapshots."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(server, ready, engine, store))
    return generate_latest(registry).decode()
