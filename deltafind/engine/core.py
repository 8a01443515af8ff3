"""The one engine core: `schedule() -> StepPlan`, `execute(plan) -> StepOutput`, `update(plan, output) -> events`.

Every caller drives this: the daemon's `Scheduler` from its engine thread, and
`Model.generate`/`stream`, `run`, `run --chat` and `bench` synchronously through
`generate`. A plan says which sequences run how many rows (decode, prefill chunk,
or pending token plus draft proposal); per-step scratch lives in the plan, not on
`Sequence`. A failure in one sequence (sampling, draft, constraint) ends that
sequence with "error"; the rest of the step goes on unchanged. Token ids only.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence as Seq_
from typing import Any

import torch

from deltafind.engine import speculative, step
from deltafind.engine.draft.policy import PolicyOptions
from deltafind.engine.prefill import RELEASE_AFTER_TOKENS, release_memory
from deltafind.engine.prefix_cache import PrefixCache, snapshot, trim_states
from deltafind.engine.sequence import Event, FinishEvent, GenRequest, Sequence
from deltafind.engine.stats import EngineStats
from deltafind.engine.step import Events, PlanItem, SchedulerLimits, StepOutput, StepPlan
from deltafind.engine.step_budget import StepBudget
from deltafind.errors import DeltafindError
from deltafind.log import get_logger
from deltafind.models.ops.batch import Batch, SequenceCache

log = get_logger(__name__)


def _device_of(net: Any) -> torch.device:
    try:
        return next(net.parameters()).device
    except (AttributeError, StopIteration):
        return torch.device("cpu")


class EngineCore:
    """Sequences waiting and running, and the three steps that move them; no threads, no queues."""

    def __init__(
        self,
        net: Any,
        eos_token_ids: Seq_[int] = (),
        limits: SchedulerLimits | None = None,
        draft: Any = None,
        draft_policy: PolicyOptions | None = None,
    ) -> None:
        self.net, self.draft = net, draft
        self.draft_policy = draft_policy or PolicyOptions()
        self.draft_enabled = True
        self.eos = set(eos_token_ids)
        self.limits = limits or SchedulerLimits()
        self.prefix = PrefixCache(self.limits.prompt_bytes)
        self.stats = EngineStats()
        self.budget = StepBudget(self.limits.step_target_s)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._vocab = (
            getattr(getattr(net, "lm_head", None), "weight", torch.empty(0, 0)).shape[0] or None
        )
        self._device = _device_of(net)
        self._rotate = 0
        self._unreleased = 0  # prompt tokens run since the heap was last trimmed
        # KDA state cannot be rewound: a prefill keeps copies of it where a later prompt may resume
        self._recurrent = getattr(
            net, "recurrent", False
        )  # models/contract.py (a stand-in net may leave it out)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: GenRequest, seq_id: int, submitted_at: float | None = None) -> None:
        """Queue a request; `submitted_at` (time.monotonic) starts its queue and latency clocks."""
        s = Sequence(seq_id, req, self.eos, self.limits.max_context)
        s.submitted_at = time.monotonic() if submitted_at is None else submitted_at
        self.waiting.append(s)

    def abort(self, seq_ids: set[int]) -> Events:
        """End these sequences (waiting or running) now."""
        gone = [s for s in [*self.waiting, *self.running] if s.seq_id in seq_ids]
        self.waiting = deque(s for s in self.waiting if s.seq_id not in seq_ids)
        self.running = [s for s in self.running if s.seq_id not in seq_ids]
        return [self._finish(s, "cancelled") for s in gone]

    def step(self) -> Events:
        """schedule, execute, update. A forward that failed on one expert's read (`rows`: the tokens that
        routed it) fails only the sequences those rows belong to and runs again without them; a failed
        verify pass runs again without drafts; any other failure fails the step's sequences."""
        plan = self.schedule()
        ended, drafts_dropped = plan.ended, False
        while plan.items:
            try:
                out = self.execute(plan)
            except Exception as e:
                hit = step.routed(plan, e)
                if hit and len(hit) < len(plan.items):
                    ended += self._fail(plan, e, hit)
                    step.rewind(plan)
                    continue
                if drafts_dropped or not any(it.proposal is not None for it in plan.items):
                    return ended + self._fail(plan, e)
                # A verify pass that failed (out of memory on the wider batch, say): the step runs again
                # without drafts, and those sequences go on target-only.
                log.warning(
                    "draft_failed",
                    during="verify",
                    error=f"{type(e).__name__}: {e}",
                    fallback="target_only",
                )
                drafts_dropped = True
                for it in plan.items:
                    if it.proposal is not None:
                        self.stats.draft.failures += 1
                        step.drop_draft(it)
                step.rewind(plan)
                continue
            return ended + self.update(plan, out)
        return ended

    # -- schedule --------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Admit waiting sequences, then plan decodes first (a rotating start, so none starves),
        then prefill chunks, within `max_step_tokens`; drafting sequences get a proposal."""
        ended = self._admit()
        running = self.running
        budget = max(self.limits.max_step_tokens, 1)
        self._rotate = (self._rotate + 1) % max(len(running), 1)
        order = running[self._rotate :] + running[: self._rotate]
        items = [PlanItem(s, 1, s.num_computed) for s in order if s.pending == 1][:budget]
        budget -= len(items)
        self.budget.target_s = self.limits.step_target_s  # a reload may change it
        # running streams wait about a target's time, or twice a step's fixed part
        prefill = self.budget.prefill_tokens(alone=not items and not self.waiting)
        prefill = budget if prefill is None else min(budget, prefill)
        for s in running:
            if s.pending > 1 and prefill > 0:
                fits = (
                    self.limits.prefill.tokens(s.num_computed)
                    if self.limits.prefill is not None
                    else prefill
                )
                n = min(s.pending, prefill, fits, self._next_snapshot(s) - s.num_computed)
                items.append(PlanItem(s, n, s.num_computed, prefill=True))
                budget -= n
                prefill -= n
        for it in items:
            s = it.seq
            if s.drafter is None or s.pending != 1 or not s.num_generated or budget <= 0:
                continue  # drafts follow the first token: the prompt (even a 1-token one) is prefilled alone
            width = min(s.drafter.width(s.num_generated), s.max_new - s.num_generated - 1, budget)
            if width > 0:
                t0 = time.perf_counter()
                it.proposal = s.drafter.propose(s.tokens, width, s.req.params, s.generator)
                it.draft_s = time.perf_counter() - t0
                if it.proposal is not None:
                    it.num_tokens = it.rows
                    budget -= len(it.proposal.tokens)
            if not s.drafter.active:
                s.drafter = None
        return StepPlan(items, ended)

    def _admit(self) -> Events:
        ended: Events = []
        while self.waiting and len(self.running) < self.limits.max_running:
            s = self.waiting.popleft()
            self.stats.hist["queue_time_seconds"].observe(time.monotonic() - s.submitted_at)
            if s.max_new == 0:
                ended.append(self._finish(s, "length"))
                continue
            try:
                s.start_constraint()
            except Exception as e:  # a broken constraint fails its own request only
                s.exception = e
                ended.append(
                    self._finish(
                        s, "error", f"the output constraint failed: {type(e).__name__}: {e}"
                    )
                )
                continue
            found = self.prefix.take(s.tokens)
            if found is not None:
                s.cache, s.cached_tokens = found
                s.num_computed = s.cached_tokens
            else:
                s.cache = SequenceCache(self.net.num_layers)
            self._start_draft(s, found is not None)
            self.running.append(s)
        return ended

    def _next_snapshot(self, s: Sequence) -> int:
        """The next prompt position where a prefill chunk ends so the recurrent state there is kept.

        Attention K/V is cut anywhere, so only a recurrent cache needs these: every `prompt_snapshot_tokens`
        (an edit mid-history resumes before it), the request's checkpoint (where a chat's history
        ends), and the prompt's last token (a retry of the same prompt reruns just that one). A
        snapshot reads no expert; the split chunk is the cost (experts both halves use are read twice)."""
        end = s.num_prompt
        if not self._recurrent or self.prefix.max_bytes <= 0:
            return end
        every, at = self.limits.prompt_snapshot_tokens, s.num_computed
        marks = [s.req.checkpoint, end - 1, (at // every + 1) * every if every > 0 else end]
        return min([p for p in marks if at < p < end] or [end])

    def _keep_snapshot(self, s: Sequence) -> None:
        """At a mark of `_next_snapshot`, or the prompt's end (a next turn may diverge right after it), keep
        the recurrent state; it is bounded with the prefix-cache entry the sequence leaves at its end."""
        at, every = s.num_computed, self.limits.prompt_snapshot_tokens
        marked = at in (s.req.checkpoint, s.num_prompt - 1, s.num_prompt) or (
            every > 0 and at % every == 0
        )
        if (
            self._recurrent
            and self.prefix.max_bytes > 0
            and s.cached_tokens < at <= s.num_prompt
            and marked
        ):
            s.states[at] = snapshot(s.cache)
            trim_states(
                s.states, self.prefix.state_budget()
            )  # never more than the caches they go to could hold

    def _start_draft(self, s: Sequence, reused: bool) -> None:
        if self.draft is None or not self.draft_enabled:
            return
        if reused and self.draft.capture_layers:
            # the source needs the target's hidden rows of every position, and a reused prefix has none
            log.debug("draft_skipped", reason="prefix_reused", request_id=s.req.request_id or None)
            return
        if s.req.chat and getattr(self.draft, "raw_only", False):
            log.debug(
                "draft_skipped", reason="raw_only_source", request_id=s.req.request_id or None
            )
            return
        drafter = speculative.Drafter(
            self.draft,
            s.req.prompt_ids,
            self.draft_policy,
            self.stats.draft,
            s.req.request_id,
            self._vocab,
        )
        if drafter.active:
            drafter.use_target_cache(s.cache)
            s.drafter = drafter

    # -- execute ---------------------------------------------------------------

    def execute(self, plan: StepPlan) -> StepOutput:
        """One forward pass over every item of the plan."""
        ids = [t for it in plan.items for t in it.input_ids()]
        rows = [it.rows for it in plan.items]
        capture = sorted(
            {
                layer
                for it in plan.items
                if it.seq.drafter is not None
                for layer in it.seq.drafter.capture_layers
            }
        )
        t0 = time.perf_counter()
        with torch.inference_mode():
            batch = Batch.of(
                [(it.seq.cache, it.num_tokens) for it in plan.items], device=self._device
            )
            batch.capture = tuple(capture)
            if any(r > 1 for r in rows):
                batch.logit_rows = tuple(rows)
            logits = self.net(
                torch.tensor(ids, dtype=torch.long, device=self._device), batch
            )  # [sum(rows), V]
        seconds = time.perf_counter() - t0
        self.budget.observe(sum(it.num_tokens for it in plan.items if it.prefill), seconds)
        return StepOutput(logits, batch.captured, [seg.start for seg in batch.segments], seconds)

    # -- update ----------------------------------------------------------------

    def update(self, plan: StepPlan, out: StepOutput) -> Events:
        """Tokens emitted, sequences finished, per-sequence errors; counters."""
        events: Events = []
        row = 0
        for it, start in zip(plan.items, out.starts, strict=True):
            s = it.seq
            try:
                with torch.inference_mode():
                    emitted = self._advance(it, out.logits[row : row + it.rows], out, start)
                events.extend((s.seq_id, e) for e in emitted)
                self._observe_tokens(s, len(emitted))
            except Exception as e:  # this sequence's failure; the others' outputs stand
                log.warning(
                    "sequence_failed",
                    request_id=s.req.request_id or None,
                    error=f"{type(e).__name__}: {e}",
                )
                s.finished, s.error, s.exception = (
                    "error",
                    f"generation failed: {type(e).__name__}: {e}",
                    e,
                )
            row += it.rows
        if any(it.proposal is not None for it in plan.items):
            self.stats.draft.verify_s += (
                out.seconds
            )  # step seconds that verified drafts (once per step)
        for it in plan.items:
            s = it.seq
            if s.drafter is not None and s.finished != "error" and s.num_computed > s.num_prompt:
                s.drafter.record(it.proposal, it.emitted, out.seconds + it.draft_s, s.num_generated)
        prompt = sum(it.num_tokens for it in plan.items if it.seq.num_computed <= it.seq.num_prompt)
        self.stats.record_step(out.seconds, len(plan.items), prompt, len(events))
        for s in {id(it.seq): it.seq for it in plan.items}.values():
            if s.finished is not None:
                self.running.remove(s)
                events.append(self._finish(s, s.finished, s.error))
        self._unreleased += prompt
        # idle after long prompts
        if self._unreleased >= RELEASE_AFTER_TOKENS and not self.has_work:
            self._unreleased = 0
            if got := release_memory():  # {} where the C library has no malloc_trim
                log.info("memory_released", **got)
        return events

    def _advance(
        self, it: PlanItem, logits: torch.Tensor, out: StepOutput, start: int
    ) -> list[Event]:
        s = it.seq
        if it.proposal is not None:
            return step.verify(it, logits, out, start)
        s.num_computed += it.num_tokens
        self._keep_snapshot(s)
        flat = slice(start, start + it.num_tokens)
        it.emitted = 0
        if s.pending == 0:  # the chunk reached the end: this step's logits pick the next token
            event = s.choose(logits[0])
            it.emitted = 1
            if s.drafter is not None:
                s.drafter.commit(s.tokens, step.drafter_rows(s, out, flat))
            return [event]
        if s.drafter is not None:  # a prefill chunk short of the end: keep its rows
            s.drafter.hold_capture(step.drafter_rows(s, out, flat))
        return []

    def _observe_tokens(self, s: Sequence, n: int) -> None:
        if not n:
            return
        now, h = time.monotonic(), self.stats.hist
        if s.last_token_at is None:
            h["time_to_first_token_seconds"].observe(now - s.submitted_at)
        else:
            for _ in range(n):  # a verify pass emits several at once: spread its gap over them
                h["inter_token_latency_seconds"].observe((now - s.last_token_at) / n)
        s.last_token_at = now

    def _fail(self, plan: StepPlan, e: Exception, items: list[PlanItem] | None = None) -> Events:
        """End `items` (default: every item of the plan) with `e`; they leave the plan and the running list."""
        items = plan.items if items is None else items
        log.error(
            "engine_step_failed",
            sequences=len(items),
            of_sequences=len(plan.items),
            tokens=sum(it.num_tokens for it in items),
            error=f"{type(e).__name__}: {e}",
            request_ids=[it.seq.req.request_id for it in items if it.seq.req.request_id] or None,
            exc_info=not isinstance(e, DeltafindError),
        )
        self.stats.errors += 1
        for it in items:
            self.running.remove(it.seq)
            it.seq.exception = e
        plan.items = [it for it in plan.items if all(it is not x for x in items)]
        return [
            self._finish(
                it.seq, "error", f"the engine failed on this step: {type(e).__name__}: {e}"
            )
            for it in items
        ]

    def _finish(
        self, s: Sequence, reason: str, error: str | None = None
    ) -> tuple[int, FinishEvent]:
        if reason != "error" and s.cache is not None and s.num_computed:
            # the cache holds exactly the tokens run so far, with the snapshots kept on the way
            self.prefix.put(s.tokens[: s.num_computed], s.cache, s.states)
        s.cache, s.states = None, {}
        if s.drafter is not None:
            s.drafter.close()
            s.drafter = None
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        self.stats.hist["request_duration_seconds"].observe(time.monotonic() - s.submitted_at)
        return s.seq_id, s.finish_event(reason, error)
