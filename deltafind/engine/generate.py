"""Synchronous generation: the engine core driven step by step on the caller's thread.

`Model.generate`/`stream`, `deltafind run`, `run --chat` and `bench` use this; the
daemon's `Scheduler` drives the same `EngineCore` from its engine thread. A
sequence that fails raises its error here. `forward_step` runs ids through one
cache outside any core (tests, and drafts that keep their own caches).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from deltafind.engine.core import EngineCore
from deltafind.engine.draft.policy import DraftStats, PolicyOptions
from deltafind.engine.sampler import SamplingParams
from deltafind.engine.sequence import FinishEvent, GenRequest
from deltafind.engine.stats import EngineStats, GenerationStats
from deltafind.engine.step import SchedulerLimits
from deltafind.errors import DeltafindError

# one sequence, no one waiting behind its prefill: no step time target, chunks only as memory needs
ONE_AT_A_TIME = SchedulerLimits(
    max_running=1, max_queue=1, max_step_tokens=1 << 30, max_context=1 << 30, step_target_s=None
)


def generate(
    net: torch.nn.Module,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    eos_token_ids: Sequence[int] = (),
    stats: GenerationStats | None = None,
    draft: Any = None,
    draft_policy: PolicyOptions | None = None,
    draft_stats: DraftStats | None = None,
    *,
    request: GenRequest | None = None,
    limits: SchedulerLimits | None = None,
    engine_stats: EngineStats | None = None,
) -> Iterator[int]:
    """Yield new token ids for `prompt_ids` under `params` (or for `request`, when given).

    With `draft` (a `DraftSource`) decoding is speculative: the same tokens under greedy,
    the same distribution under sampling. The prompt is prefilled in chunks as `limits.prefill`
    allows (one pass when it fits; `Model.stream` passes the model's plan).
    `stats`, `draft_stats` and `engine_stats` (the core's counters and histograms) are filled.
    """
    req = request or GenRequest(tuple(prompt_ids), params)
    stats = stats if stats is not None else GenerationStats()
    stats.prompt_tokens = len(req.prompt_ids)
    core = EngineCore(net, eos_token_ids, limits or ONE_AT_A_TIME, draft, draft_policy)
    if engine_stats is not None:
        core.stats = engine_stats
    if draft_stats is not None:
        core.stats.draft = draft_stats
    core.add(req, 0)
    try:
        while core.has_work:
            t0, first = time.perf_counter(), stats.new_tokens == 0
            events = core.step()
            if first:
                stats.prefill_s += time.perf_counter() - t0
            else:
                stats.decode_s += time.perf_counter() - t0
            for _, event in events:
                if not isinstance(event, FinishEvent):
                    stats.new_tokens += 1
                    yield event.token_id
                    continue
                stats.finish_reason = event.reason
                if event.reason == "error":
                    raise event.exception or DeltafindError(event.error or "generation failed")
    finally:
        core.abort({0})  # a caller that stops early closes the sequence's draft session
