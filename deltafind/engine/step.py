"""One step of the engine core (engine/core.py): the limits it is planned within, the plan (which
sequences run how many rows) and the forward's output, and the per-item work that reads no core
state: which items a failed expert read hit, rewinding a failed forward, verifying a proposal.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch

from deltafind.engine import speculative
from deltafind.engine.draft.base import Proposal
from deltafind.engine.prefill import PrefillPlan
from deltafind.engine.sequence import Event, Sequence
from deltafind.log import get_logger
from deltafind.models.ops.kda_layer import RollbackError

log = get_logger(__name__)
Events = list[tuple[int, Event]]  # (seq_id, event) in the order they happened


@dataclass(frozen=True)
class SchedulerLimits:
    max_running: int = 8
    max_queue: int = 64
    max_step_tokens: int = 256  # prefill chunk budget per step, decode tokens included
    max_context: int = 2048
    prompt_bytes: int = 0
    prefill: PrefillPlan | None = (
        None  # a prefill chunk's size from activation memory (None: max_step_tokens only)
    )
    prompt_snapshot_tokens: int = (
        4096  # recurrent (KDA) state is kept every this many prompt tokens, for prefix reuse
    )
    step_target_s: float | None = (
        0.5  # a prefilling step's wall-time target (engine/step_budget.py); None: off
    )


@dataclass
class PlanItem:
    """One sequence's part of a step: `num_tokens` fed after `base` cached ones; `proposal` drafts."""

    seq: Sequence
    num_tokens: int
    base: int
    proposal: Proposal | None = None
    draft_s: float = 0.0
    prefill: bool = False  # a chunk of a prompt (more than one token left to feed when planned)
    emitted: int = 0  # tokens this step emitted (set by update)

    @property
    def rows(self) -> int:
        """Logit rows this item needs: the pending token plus one per draft token, else the last token's."""
        return 1 + len(self.proposal.tokens) if self.proposal is not None else 1

    def input_ids(self) -> list[int]:
        s = self.seq
        if self.proposal is not None:
            return [s.tokens[self.base], *self.proposal.tokens]
        return s.tokens[self.base : self.base + self.num_tokens]


@dataclass
class StepPlan:
    items: list[PlanItem]
    ended: Events = field(
        default_factory=list
    )  # sequences that ended while planning (nothing to run)


@dataclass
class StepOutput:
    logits: torch.Tensor  # [sum(rows), V]
    captured: dict[
        int, torch.Tensor
    ]  # target layer -> hidden rows [num_tokens, H], for drafts that need them
    starts: list[int]  # flat index of each item's first token
    seconds: float


def routed(plan: StepPlan, e: Exception) -> list[PlanItem] | None:
    """The items whose tokens routed the expert that failed (`e.rows`, flat token indices), or None: unknown."""
    rows = getattr(e, "rows", None)
    if rows is None:
        return None
    hit, start = [], 0
    for it in plan.items:
        i = bisect.bisect_left(rows, start)
        if i < len(rows) and rows[i] < start + it.num_tokens:
            hit.append(it)
        start += it.num_tokens
    return hit


def rewind(plan: StepPlan) -> None:
    """Undo a failed forward's partial writes so the plan's items can run again. A recurrent state
    (KDA) that cannot roll back that far starts over: its whole sequence is prefilled again (the same
    tokens; K3's state agrees to fp32 rounding, as across prefill chunkings)."""
    for it in plan.items:
        s = it.seq
        try:
            s.cache.truncate(it.base)
        except RollbackError as e:
            log.info(
                "sequence_recomputed",
                request_id=s.req.request_id or None,
                tokens=it.base,
                reason=str(e),
            )
            s.cache.truncate(0)
            if it.proposal is not None:
                drop_draft(it)
            it.num_tokens, it.base, it.prefill = it.base + it.num_tokens, 0, True
            s.num_computed = 0


def drop_draft(it: PlanItem) -> None:
    it.seq.drafter.close()
    it.seq.drafter, it.proposal, it.num_tokens = None, None, 1


def verify(it: PlanItem, logits: torch.Tensor, out: StepOutput, start: int) -> list[Event]:
    """Accept a prefix of the proposal from its k+1 rows of logits [k+1, V]; emit, then truncate the cache."""
    s, prop = it.seq, it.proposal
    assert prop is not None
    rows, tokens, q = s.verify_rows(logits, list(prop.tokens), prop.q)
    emitted = speculative.accept(rows, tokens, q, s.req.params, s.generator)
    it.emitted = len(emitted)
    events: list[Event] = []
    for j, token in enumerate(emitted):
        events.append(s.record(token, logits[j]))
        if s.finished is not None:
            break
    kept = len(events)  # rows kept: the pending token and the drafts emitted before the last token
    s.num_computed = it.base + kept
    if s.cache.length > s.num_computed:
        s.cache.truncate(s.num_computed)
    if s.drafter is not None:
        s.drafter.commit(s.tokens, drafter_rows(s, out, slice(start, start + kept)))
    return events


def drafter_rows(s: Sequence, out: StepOutput, flat: slice) -> torch.Tensor | None:
    layers = s.drafter.capture_layers if s.drafter is not None else ()
    return speculative.captured_rows(out, layers, flat) if layers else None
