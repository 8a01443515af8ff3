"""GET /metrics: Prometheus text exposition, written by hand (no client library).

Request counters live here; engine and store figures come from the engine
client's `status()` and the daemon's `extra_metrics()` callable, so this module
knows neither the scheduler's internals nor the store.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

# (name, type, help, [(labels, value), ...])
Metric = tuple[str, str, str, list[tuple[dict[str, str], float]]]
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")


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

    def metrics(self) -> list[Metric]:
        with self._lock:
            reqs = [({"endpoint": e, "status": s}, float(v)) for (e, s), v in sorted(self.requests.items())]
            return [
                ("deltafind_http_requests_total", "counter", "HTTP requests by endpoint and status.", reqs),
                ("deltafind_request_prompt_tokens_total", "counter", "Prompt tokens of accepted requests.",
                 [({}, float(self.prompt_tokens))]),
                ("deltafind_request_completion_tokens_total", "counter", "Completion tokens sent to clients.",
                 [({}, float(self.completion_tokens))]),
            ]


def engine_metrics(status: Any) -> list[Metric]:
    """Figures of the engine's `status()` (an EngineStatus)."""
    st = status.stats
    h = st.hist["step_seconds"]
    buckets, total = [], 0
    for le, n in zip([*h.bounds, float("inf")], h.counts, strict=True):
        total += n
        buckets.append(({"le": "+Inf" if le == float("inf") else repr(le)}, float(total)))
    return [
        ("deltafind_queue_waiting", "gauge", "Requests waiting for a free slot.", [({}, float(status.waiting))]),
        ("deltafind_sequences_running", "gauge", "Sequences generating now.", [({}, float(status.running))]),
        ("deltafind_draining", "gauge", "1 while the server refuses new requests.", [({}, float(status.draining))]),
        ("deltafind_decode_tokens_per_second", "gauge", "Tokens generated per second over the last 10 s.",
         [({}, round(status.tok_s, 3))]),
        ("deltafind_engine_steps_total", "counter", "Forward steps run.", [({}, float(st.steps))]),
        ("deltafind_prompt_tokens_total", "counter", "Prompt tokens run through the model.", [({}, float(st.prompt_tokens))]),
        ("deltafind_generated_tokens_total", "counter", "Tokens generated.", [({}, float(st.generated_tokens))]),
        ("deltafind_sequences_finished_total", "counter", "Sequences ended, by reason.",
         [({"reason": k}, float(v)) for k, v in sorted(st.finished.items())]),
        ("deltafind_prefix_cache_hits_total", "counter", "Prompts that reused a cached prefix.", [({}, float(status.prefix_hits))]),
        ("deltafind_prefix_cache_bytes", "gauge", "Bytes held by the prefix cache.", [({}, float(status.prefix_bytes))]),
        ("deltafind_step_seconds", "histogram", "Time of one forward step.",
         [*[({**lbl, "__suffix": "_bucket"}, v) for lbl, v in buckets],
          ({"__suffix": "_sum"}, h.sum), ({"__suffix": "_count"}, float(st.steps))]),
        *_draft_metrics(st),
    ]


def _draft_metrics(st: Any) -> list[Any]:
    """Speculative decoding counters (engine/speculative.py), when the engine keeps them."""
    d = getattr(st, "draft", None)
    if d is None:
        return []
    src = {"source": d.source or "none"}
    return [
        ("deltafind_draft_tokens_total", "counter", "Draft tokens, proposed and accepted by the target.",
         [({**src, "outcome": "proposed"}, float(d.proposed)), ({**src, "outcome": "accepted"}, float(d.accepted))]),
        ("deltafind_draft_acceptance_ratio", "gauge", "Share of proposed draft tokens the target accepted.",
         [(src, round(d.acceptance_rate, 4))]),
        ("deltafind_draft_verify_passes_total", "counter", "Target passes that verified a draft.", [(src, float(d.steps))]),
        ("deltafind_draft_saved_seconds", "gauge",
         "Estimated decode time drafting saved (negative: lost): emitted tokens x target-only step time - drafting step time.",
         [(src, round(d.saved_s, 4))]),
        ("deltafind_draft_failures_total", "counter", "Draft failures that fell back to target-only.", [(src, float(d.failures))]),
    ]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render(metrics: Iterable[Metric]) -> str:
    lines = []
    for name, kind, help_, samples in metrics:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            labels = dict(labels)
            suffix = labels.pop("__suffix", "")
            lbl = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
            v = float(value)
            text = str(int(v)) if v.is_integer() else repr(v)
            lines.append(f"{name}{suffix}{'{' + lbl + '}' if lbl else ''} {text}")
    return "\n".join(lines) + "\n"
