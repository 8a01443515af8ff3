"""The engine's counters, as plain data: steps, tokens, finishes, drafts and latency histograms.

`EngineStats.snapshot()` is the engine's one status snapshot: JSON (`deltafinctl
status --json`, `bench --json`), the `--stats` text and `/metrics` all render it.
Times are seconds; histograms keep cumulative-free bucket counts, Prometheus style.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from deltafind.engine.draft.policy import DraftStats

STEP_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# per-request latencies, as vLLM buckets them: time to first token, inter-token, queue, whole request
LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
HISTOGRAMS = {  # name -> (buckets, help)
    "step_seconds": (STEP_BUCKETS_S, "Time of one forward step."),
    "time_to_first_token_seconds": (
        LATENCY_BUCKETS_S,
        "Time from submission to a request's first token.",
    ),
    "inter_token_latency_seconds": (LATENCY_BUCKETS_S, "Time between two tokens of one request."),
    "queue_time_seconds": (LATENCY_BUCKETS_S, "Time a request waited for a free slot."),
    "request_duration_seconds": (LATENCY_BUCKETS_S, "Time from submission to a request's end."),
}


@dataclass
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # one per bound, then +Inf (not cumulative)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = self.counts or [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "buckets": list(self.bounds),
            "counts": list(self.counts),
            "sum": round(self.sum, 6),
            "count": self.count,
        }


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens run through the model (reused ones excluded)
    generated_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    max_batch: int = 0
    errors: int = 0  # steps whose forward pass failed
    draft: DraftStats = field(default_factory=DraftStats)  # summed over every drafting sequence
    hist: dict[str, Histogram] = field(
        default_factory=lambda: {k: Histogram(b) for k, (b, _) in HISTOGRAMS.items()}
    )

    def record_step(
        self, seconds: float, sequences: int, prompt_tokens: int, generated: int
    ) -> None:
        self.steps += 1
        self.hist["step_seconds"].observe(seconds)
        self.max_batch = max(self.max_batch, sequences)
        self.prompt_tokens += prompt_tokens
        self.generated_tokens += generated

    def snapshot(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "finished": dict(self.finished),
            "max_batch": self.max_batch,
            "step_errors": self.errors,
            "draft": self.draft.as_dict(),
            "histograms": {k: h.as_dict() for k, h in self.hist.items()},
        }


@dataclass
class GenerationStats:
    """One synchronous request's figures (Model.stream, run, bench)."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    finish_reason: str = ""

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        # the first new token comes from prefill; decode steps produce the rest
        steps = max(self.new_tokens - 1, 0)
        return steps / self.decode_s if self.decode_s else 0.0
