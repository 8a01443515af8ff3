"""GET /metrics: the owners' status snapshots, exposed through prometheus-client.

Request counters live here (`ServerMetrics`); the engine's figures come from its
client's `snapshot()` and the store's from the daemon's `store_snapshot()`
callable, so this module knows neither the scheduler's internals nor the store.
One collector maps each snapshot key to a metric family; prometheus-client writes
the exposition text.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterator, Sequence
from itertools import accumulate
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

ENDPOINTS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/models",
    "/health",
    "/metrics",
)
CONTENT_TYPE = CONTENT_TYPE_LATEST
SCALARS = [  # (snapshot, key, metric, kind, help): one unlabelled sample each
    (
        "server",
        "prompt_tokens",
        "deltafind_request_prompt_tokens",
        "counter",
        "Prompt tokens of accepted requests.",
    ),
    (
        "server",
        "completion_tokens",
        "deltafind_request_completion_tokens",
        "counter",
        "Completion tokens sent to clients.",
    ),
    ("engine", "waiting", "deltafind_queue_waiting", "gauge", "Requests waiting for a free slot."),
    ("engine", "running", "deltafind_sequences_running", "gauge", "Sequences generating now."),
    (
        "engine",
        "draining",
        "deltafind_draining",
        "gauge",
        "1 while the server refuses new requests.",
    ),
    (
        "engine",
        "tok_s",
        "deltafind_decode_tokens_per_second",
        "gauge",
        "Tokens generated per second over the last 10 s.",
    ),
    (
        "engine",
        "prefix_bytes",
        "deltafind_prefix_cache_bytes",
        "gauge",
        "Bytes held by the prefix cache.",
    ),
    ("engine", "steps", "deltafind_engine_steps", "counter", "Forward steps run."),
    (
        "engine",
        "prompt_tokens",
        "deltafind_prompt_tokens",
        "counter",
        "Prompt tokens run through the model.",
    ),
    ("engine", "generated_tokens", "deltafind_generated_tokens", "counter", "Tokens generated."),
    (
        "engine",
        "prefix_hits",
        "deltafind_prefix_cache_hits",
        "counter",
        "Prompts that reused a cached prefix.",
    ),
    (
        "engine",
        "prefix_misses",
        "deltafind_prefix_cache_misses",
        "counter",
        "Prompts that found no cached prefix.",
    ),
    (
        "engine",
        "prefix_reused_tokens",
        "deltafind_prefix_cache_reused_tokens",
        "counter",
        "Prompt tokens whose cache came from the prefix cache instead of being run.",
    ),
    (
        "engine",
        "step_errors",
        "deltafind_engine_step_errors",
        "counter",
        "Forward steps that failed (their sequences ended with an error).",
    ),
    (
        "store",
        "cache_requested",
        "deltafind_expert_requests",
        "counter",
        "Expert fetches asked by the model.",
    ),
    (
        "store",
        "cache_hit_rate",
        "deltafind_expert_cache_hit_ratio",
        "gauge",
        "Share of expert fetches served from memory.",
    ),
    (
        "store",
        "cache_used_bytes",
        "deltafind_expert_cache_bytes",
        "gauge",
        "Bytes of experts held in the cache.",
    ),
    (
        "store",
        "prefetch_recall",
        "deltafind_prefetch_recall",
        "gauge",
        "Share of routed experts that prefetch predicted.",
    ),
]


def family(
    kind: str,
    name: str,
    help_: str,
    samples: list[tuple[list[str], float]],
    labels: Sequence[str] = (),
) -> Metric:
    out = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
        name, help_, labels=list(labels)
    )
    for values, value in samples:
        out.add_metric(values, float(value))
    return out


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

    def count_tokens(self, prompt: int = 0, completion: int = 0) -> None:
        with self._lock:
            self.prompt_tokens += prompt
            self.completion_tokens += completion

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "requests": dict(self.requests),
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
            }


class SnapshotCollector(Collector):
    """One scrape's snapshots (server, engine, store; None: not loaded yet) as metric families."""

    def __init__(
        self,
        server: dict[str, Any],
        ready: bool,
        engine: dict[str, Any] | None,
        store: dict[str, Any] | None,
    ) -> None:
        self.snaps, self.ready = {"server": server, "engine": engine, "store": store or None}, ready

    def collect(self) -> Iterator[Metric]:
        server, e, st = self.snaps["server"], self.snaps["engine"], self.snaps["store"]
        yield family(
            "counter",
            "deltafind_http_requests",
            "HTTP requests by endpoint and status.",
            [([ep, code], n) for (ep, code), n in sorted(server["requests"].items())],
            ["endpoint", "status"],
        )
        yield family(
            "gauge",
            "deltafind_ready",
            "1 once the model is loaded and warmed up.",
            [([], self.ready)],
        )
        for snap, key, name, kind, help_ in SCALARS:
            if self.snaps[snap] is not None:
                yield family(kind, name, help_, [([], self.snaps[snap][key])])  # type: ignore[index]
        if e is not None:
            yield family(
                "counter",
                "deltafind_sequences_finished",
                "Sequences ended, by reason.",
                [([r], n) for r, n in sorted(e["finished"].items())],
                ["reason"],
            )
            for key, (_, help_) in HISTOGRAMS.items():
                h = e["histograms"][key]  # counts per bucket; the exposition's are cumulative
                buckets = list(
                    zip([*map(repr, h["buckets"]), "+Inf"], accumulate(h["counts"]), strict=True)
                )
                yield HistogramMetricFamily(
                    f"deltafind_{key}", help_, buckets=buckets, sum_value=h["sum"]
                )
            d, src = e["draft"], [e.get("draft_source") or e["draft"]["source"] or "none"]
            yield family(
                "counter",
                "deltafind_draft_tokens",
                "Draft tokens, proposed and accepted by the target.",
                [([*src, "proposed"], d["proposed"]), ([*src, "accepted"], d["accepted"])],
                ["source", "outcome"],
            )
            for kind, name, key, help_ in [
                (
                    "gauge",
                    "deltafind_draft_acceptance_ratio",
                    "acceptance_rate",
                    "Share of proposed draft tokens the target accepted.",
                ),
                (
                    "counter",
                    "deltafind_draft_verify_passes",
                    "steps",
                    "Target passes that verified a draft.",
                ),
                (
                    "gauge",
                    "deltafind_draft_saved_seconds",
                    "saved_s",
                    "Estimated decode time drafting saved (negative: "
                    "lost): emitted tokens x target-only step time - drafting step time.",
                ),
                (
                    "counter",
                    "deltafind_draft_failures",
                    "failures",
                    "Draft failures that fell back to target-only.",
                ),
            ]:
                yield family(kind, name, help_, [(src, d[key])], ["source"])
        if st is not None:
            yield family(
                "counter",
                "deltafind_expert_cache_hits",
                "Expert fetches served from memory, by tier.",
                [(["cache"], st["cache_hits"]), (["pinned"], st["pinned_hits"])],
                ["tier"],
            )
            drives = [[str(d["index"])] for d in st["drives"]]
            yield family(
                "counter",
                "deltafind_drive_read_bytes",
                "Bytes read per drive.",
                [(i, d["bytes_read"]) for i, d in zip(drives, st["drives"], strict=True)],
                ["drive"],
            )
            yield family(
                "gauge",
                "deltafind_drive_healthy",
                "1 when the drive's pack is readable.",
                [(i, d["healthy"]) for i, d in zip(drives, st["drives"], strict=True)],
                ["drive"],
            )
            yield family(
                "counter",
                "deltafind_prefetch_reads",
                "Prefetch reads, by outcome.",
                [([o], st[f"prefetch_{o}"]) for o in ("issued", "used", "wasted")],
                ["outcome"],
            )


def render(
    server: dict[str, Any],
    ready: bool = False,
    engine: dict[str, Any] | None = None,
    store: dict[str, Any] | None = None,
) -> str:
    """The Prometheus text exposition of one scrape's snapshots."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(server, ready, engine, store))
    return generate_latest(registry).decode()
