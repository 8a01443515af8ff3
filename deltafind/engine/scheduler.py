"""Continuous batching: one engine thread runs every admitted sequence in each step.

Request threads `submit` a `GenRequest` and read `TokenEvent`s back from their
`Handle`; the engine thread admits waiting requests up to `max_running`, then
runs one forward over a `Batch` of all running sequences — one token per
decoding sequence, a chunk of prompt per prefilling one (chunked prefill, within
`max_step_tokens`) — so each expert is read once per step for all of them.
Knows nothing of HTTP or text; the server cancels a handle to stop a sequence.
"""

from __future__ import annotations

import bisect
import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from deltafind.engine.draft.policy import DraftStats, PolicyOptions
from deltafind.engine.prefix_cache import PrefixCache
from deltafind.engine.sequence import Event, FinishEvent, GenRequest, Handle
from deltafind.engine.sequence import Sequence as Seq
from deltafind.engine.speculative import Drafter, accept, captured_rows
from deltafind.errors import DeltafindError
from deltafind.log import get_logger
from deltafind.models.ops.batch import Batch, SequenceCache

log = get_logger(__name__)
STEP_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class QueueFull(DeltafindError):
    """Every slot is busy and the wait queue is full; retry later (HTTP 429)."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Draining(DeltafindError):
    """The engine takes no new requests (drain or shutdown; HTTP 503)."""


@dataclass(frozen=True)
class SchedulerLimits:
    max_running: int = 8
    max_queue: int = 64
    max_step_tokens: int = 256  # prefill chunk budget per step, decode tokens included
    max_context: int = 2048
    prefix_cache_bytes: int = 0


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens run through the model (reused ones excluded)
    generated_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    step_s_sum: float = 0.0
    step_buckets: list[int] = field(default_factory=lambda: [0] * (len(STEP_BUCKETS_S) + 1))
    max_batch: int = 0
    errors: int = 0
    draft: DraftStats = field(default_factory=DraftStats)  # summed over every drafting sequence


@dataclass(frozen=True)
class EngineStatus:
    running: int
    waiting: int
    draining: bool
    tok_s: float
    stats: EngineStats
    limits: SchedulerLimits
    prefix_hits: int
    prefix_misses: int
    prefix_bytes: int


def _device_of(net: Any) -> torch.device:
    try:
        return next(net.parameters()).device
    except (AttributeError, StopIteration):
        return torch.device("cpu")


class Scheduler:
    """Owns the model's forward passes; all other threads talk through submit/cancel/status."""

    def __init__(self, net: Any, eos_token_ids: Sequence[int] = (), limits: SchedulerLimits | None = None,
                 draft: Any = None, draft_policy: PolicyOptions | None = None) -> None:
        """`draft` (a `DraftSource`) turns on speculative decoding under `draft_policy`."""
        self.net = net
        self.draft = draft
        self.draft_policy = draft_policy or PolicyOptions()
        self._vocab = getattr(getattr(net, "lm_head", None), "weight", torch.empty(0, 0)).shape[0] or None
        self.eos = set(eos_token_ids)
        self.limits = limits or SchedulerLimits()
        self.prefix = PrefixCache(self.limits.prefix_cache_bytes)
        self.stats = EngineStats()
        self._device = _device_of(net)
        self._cv = threading.Condition()
        self._waiting: deque[Seq] = deque()
        self._running: list[Seq] = []
        self._calls: list[Callable[[], None]] = []
        self._ids = itertools.count()
        self._rotate = 0
        self._draining = False
        self._stopped = False
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of recent steps, for tok/s
        self._thread = threading.Thread(target=self._loop, name="deltafind-engine", daemon=True)
        self._thread.start()

    # -- the request side -----------------------------------------------------

    def submit(self, req: GenRequest, mux: queue.Queue[tuple[int, Event]] | None = None) -> Handle:
        """Queue a request; raises QueueFull (wait queue full) or Draining.

        With `mux`, events go there as (handle.seq_id, event), so one reader can follow
        several sequences (n > 1) without polling.
        """
        with self._cv:
            if self._draining or self._stopped:
                raise Draining("the server is draining and takes no new requests; retry on another instance or later")
            free = self.limits.max_running - len(self._running)
            if len(self._waiting) >= self.limits.max_queue + max(0, free):
                raise QueueFull(f"the server is busy ({len(self._running)} running, {len(self._waiting)} waiting); retry shortly")
            seq_id = next(self._ids)
            handle = Handle(seq_id, self._wake, mux)
            self._waiting.append(Seq(seq_id, req, handle, self.eos, self.limits.max_context))
            self._cv.notify_all()
            return handle

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the engine thread between two steps (touching the model safely)."""
        with self._cv:
            self._calls.append(fn)
            self._cv.notify_all()

    def call(self, fn: Callable[[], Any], timeout: float | None = 30.0) -> Any:
        """Run `fn` between steps and return its result (or raise its exception)."""
        done = threading.Event()
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as e:  # re-raised in the caller's thread
                box["error"] = e
            finally:
                done.set()

        self.call_soon(run)
        if not done.wait(timeout):
            raise TimeoutError("the engine did not run the call in time")
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def configure(self, limits: SchedulerLimits) -> None:
        """Apply new limits (reload); running sequences keep their own."""
        with self._cv:
            self.limits = limits
            self._calls.append(lambda: self.prefix.resize(limits.prefix_cache_bytes))
            self._cv.notify_all()

    def configure_draft(self, policy: PolicyOptions | None, enabled: bool = True) -> None:
        """New draft policy (reload): sequences admitted from now on use it; False stops drafting."""
        with self._cv:
            if policy is not None:
                self.draft_policy = policy
            self._draft_enabled = enabled

    _draft_enabled = True

    def drain(self) -> None:
        """Refuse new requests; running and waiting ones go on."""
        with self._cv:
            self._draining = True

    def resume(self) -> None:
        with self._cv:
            self._draining = False

    @property
    def draining(self) -> bool:
        return self._draining

    def cancel_all(self) -> int:
        """Cancel every running and waiting sequence; returns how many."""
        with self._cv:
            seqs = [*self._running, *self._waiting]
        for s in seqs:
            s.handle.cancel()
        return len(seqs)

    @property
    def num_active(self) -> int:
        with self._cv:
            return len(self._running) + len(self._waiting)

    def status(self) -> EngineStatus:
        with self._cv:
            now = time.monotonic()
            while self._recent and self._recent[0][0] < now - 10.0:
                self._recent.popleft()
            span = now - self._recent[0][0] if self._recent else 0.0
            tokens = sum(n for _, n in self._recent)
            return EngineStatus(
                len(self._running), len(self._waiting), self._draining,
                tokens / span if span > 0.5 else 0.0, self.stats, self.limits,
                self.prefix.hits, self.prefix.misses, self.prefix.used_bytes,
            )

    def close(self, timeout: float = 10.0) -> None:
        """Cancel everything and stop the engine thread."""
        self.cancel_all()
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self._thread.join(timeout)

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    # -- the engine thread ----------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._stopped or self._calls or self._running or self._waiting):
                    self._cv.wait()
                calls, self._calls = self._calls, []
                if self._stopped and not calls:
                    for s in [*self._running, *self._waiting]:
                        self._finish(s, "cancelled")
                    self._running, self._waiting = [], deque()
                    return
            for fn in calls:
                try:
                    fn()
                except Exception:  # a call's failure is the caller's; the engine goes on
                    log.exception("engine_call_failed")
            with self._cv:
                self._reap()
                self._admit()
                running = list(self._running)
            if running:
                self._step(running)

    def _reap(self) -> None:
        for s in [s for s in self._waiting if s.handle.cancelled]:
            self._waiting.remove(s)
            self._finish(s, "cancelled")
        keep = []
        for s in self._running:
            if s.handle.cancelled:
                self._finish(s, "cancelled")
            else:
                keep.append(s)
        self._running = keep

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.limits.max_running:
            s = self._waiting.popleft()
            if s.max_new == 0:
                self._finish(s, "length")
                continue
            found = self.prefix.take(s.tokens)
            if found is not None:
                s.cache, s.cached_tokens = found
                s.num_computed = s.cached_tokens
            else:
                s.cache = SequenceCache(self.net.num_layers)
            self._start_draft(s, found is not None)
            self._running.append(s)

    def _start_draft(self, s: Seq, reused: bool) -> None:
        if self.draft is None or not self._draft_enabled:
            return
        if reused and self.draft.capture_layers:
            # the source needs the target's hidden rows of every position, and a reused prefix has none
            log.debug("draft_skipped", reason="prefix_reused", request_id=s.req.request_id or None)
            return
        if s.req.chat and getattr(self.draft, "raw_only", False):
            log.debug("draft_skipped", reason="raw_only_source", request_id=s.req.request_id or None)
            return
        s.drafter = Drafter(self.draft, s.req.prompt_ids, self.draft_policy, self.stats.draft, s.req.request_id, self._vocab)
        if s.drafter.active:
            s.drafter.use_target_cache(s.cache)
        else:
            s.drafter = None

    def _plan(self, running: list[Seq]) -> list[tuple[Seq, int]]:
        """(sequence, tokens to run) for this step: decodes, then prefill chunks, within the budget.

        Decodes come first (one token each, plus a drafting sequence's proposal);
        when they alone exceed the budget, the ones left out go first next step (a
        rotating start), so none starves.
        """
        budget = max(self.limits.max_step_tokens, 1)
        self._rotate = (self._rotate + 1) % max(len(running), 1)
        order = running[self._rotate :] + running[: self._rotate]
        plan = [(s, 1) for s in order if s.pending == 1][:budget]
        budget -= len(plan)
        for s in running:
            if s.pending > 1 and budget > 0:
                n = min(s.pending, budget)
                plan.append((s, n))
                budget -= n
        for i, (s, _) in enumerate(plan):
            s.proposal, s.draft_s, s.emitted, s.step_base = None, 0.0, 1, s.num_computed
            if s.drafter is not None and s.pending == 1 and budget > 0:
                width = min(s.drafter.width(s.num_generated), s.max_new - s.num_generated - 1, budget)
                if width > 0:
                    t0 = time.perf_counter()
                    s.proposal = s.drafter.propose(s.tokens, width, s.req.params, s.generator)
                    s.draft_s = time.perf_counter() - t0
                    if s.proposal is not None:
                        plan[i] = (s, 1 + len(s.proposal.tokens))
                        budget -= len(s.proposal.tokens)
                if not s.drafter.active:
                    s.drafter = None
        return plan

    def _step(self, running: list[Seq]) -> None:
        plan = self._plan(running)
        try:
            events = self._run(plan)
        except Exception as e:
            if any(s.proposal is not None for s, _ in plan):
                # A verify pass that failed (out of memory on the wider batch, say): the step runs
                # again without drafts, and those sequences go on target-only.
                log.warning("draft_failed", during="verify", error=f"{type(e).__name__}: {e}", fallback="target_only")
                try:
                    for s, _ in plan:
                        s.num_computed = s.step_base
                        s.cache.truncate(s.num_computed)
                        if s.proposal is not None:
                            self.stats.draft.failures += 1
                            s.drafter.close()
                            s.drafter, s.proposal = None, None
                    events = self._run([(s, 1 if s.pending == 1 else n) for s, n in plan])
                except Exception as e2:
                    self._fail_step(plan, e2)
                    return
            else:
                self._fail_step(plan, e)
                return
        with self._cv:
            for s, event in events:
                s.handle.put(event)
            for s in {id(s): s for s, _ in events}.values():
                if s.finished is not None:
                    self._running.remove(s)
                    self._finish(s, s.finished)

    def _fail_step(self, plan: list[tuple[Seq, int]], e: Exception) -> None:
        log.exception("engine_step_failed", sequences=len(plan), tokens=sum(n for _, n in plan))
        self.stats.errors += 1
        with self._cv:
            for s, _ in plan:
                self._running.remove(s)
                self._finish(s, "error", f"the engine failed on this step: {type(e).__name__}: {e}")

    def _run(self, plan: list[tuple[Seq, int]]) -> list[tuple[Seq, Any]]:
        """One forward over the plan; returns the token events it produced, in order."""
        ids: list[int] = []
        rows: list[int] = []
        capture: set[int] = set()
        for s, n in plan:
            ids.extend(s.tokens[s.num_computed : s.num_computed + (1 if s.proposal is not None else n)])
            if s.proposal is not None:  # [pending, d1 .. dk]
                ids.extend(s.proposal.tokens)
            rows.append(n if s.proposal is not None else 1)
            if s.drafter is not None:
                capture.update(s.drafter.capture_layers)
        t0 = time.perf_counter()
        with torch.inference_mode():
            batch = Batch.of([(s.cache, n) for s, n in plan], device=self._device)
            batch.capture = tuple(sorted(capture))
            if any(r > 1 for r in rows):
                batch.logit_rows = tuple(rows)
            logits = self.net(torch.tensor(ids, dtype=torch.long, device=self._device), batch)  # [sum(rows), V]
            events: list[tuple[Seq, Any]] = []
            row = 0
            for (s, n), seg, r in zip(plan, batch.segments, rows, strict=True):
                base = s.num_computed
                s.num_computed += n
                flat = slice(seg.start, seg.start + n)
                if s.proposal is not None:
                    events.extend((s, e) for e in self._verify(s, logits[row : row + r], base, batch, flat))
                elif s.pending == 0:  # the chunk reached the end: this step's logits pick the next token
                    events.append((s, s.choose(logits[row])))
                    if s.drafter is not None:
                        s.drafter.commit(s.tokens, self._rows(s, batch, flat))
                elif s.drafter is not None:  # a prefill chunk short of the end: keep its rows
                    s.drafter.hold_capture(self._rows(s, batch, flat))
                row += r
        dt = time.perf_counter() - t0
        if any(s.proposal is not None for s, _ in plan):
            self.stats.draft.verify_s += dt  # step seconds that verified drafts (once per step)
        for s, _ in plan:
            if s.drafter is not None and s.num_computed > s.num_prompt:
                s.drafter.record(s.proposal, s.emitted, dt + s.draft_s, s.num_generated)
            s.proposal = None
        st = self.stats
        st.steps += 1
        st.step_s_sum += dt
        st.step_buckets[bisect.bisect_left(STEP_BUCKETS_S, dt)] += 1
        st.max_batch = max(st.max_batch, len(plan))
        st.prompt_tokens += sum(n for s, n in plan if s.num_computed <= s.num_prompt)
        st.generated_tokens += len(events)
        with self._cv:
            self._recent.append((time.monotonic(), len(events)))
        return events

    @staticmethod
    def _rows(s: Seq, batch: Batch, flat: slice) -> torch.Tensor | None:
        layers = s.drafter.capture_layers if s.drafter is not None else ()
        return captured_rows(batch, layers, flat) if layers else None

    def _verify(self, s: Seq, logits: torch.Tensor, base: int, batch: Batch, flat: slice) -> list[Any]:
        """Accept a prefix of `s.proposal` from its k+1 rows of logits [k+1, V]; emit, then truncate."""
        prop = s.proposal
        tokens = prop.tokens
        scored = torch.stack([s.scores(logits[i], tokens[:i]) for i in range(len(tokens) + 1)])  # [k+1, V]
        emitted = accept(scored, tokens, prop.q, s.req.params, s.generator)
        s.emitted = len(emitted)
        events = []
        for j, token in enumerate(emitted):
            events.append(s.record(token, logits[j]))
            if s.finished is not None:
                break
        kept = len(events)  # rows kept: the pending token and the drafts emitted before the last token
        s.num_computed = base + kept
        if s.cache.length > s.num_computed:
            s.cache.truncate(s.num_computed)
        if s.drafter is not None:
            rows = self._rows(s, batch, slice(flat.start, flat.start + kept))
            s.drafter.commit(s.tokens, rows)
        return events

    def _finish(self, s: Seq, reason: str, error: str | None = None) -> None:
        if reason != "error" and s.cache is not None and s.num_computed:
            # the cache holds exactly the tokens run so far: a later prompt may extend them
            self.prefix.put(s.tokens[: s.num_computed], s.cache)
        s.cache = None
        if s.drafter is not None:
            s.drafter.close()
            s.drafter = None
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        s.handle.put(s.finish_event(reason, error))


def collect(handle: Handle, timeout: float | None = None) -> tuple[list[int], FinishEvent]:
    """Wait for a whole sequence: its token ids and its FinishEvent."""
    tokens: list[int] = []
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        event = handle.get(left)
        if event is None:
            raise TimeoutError("the sequence did not finish in time")
        if isinstance(event, FinishEvent):
            return tokens, event
        tokens.append(event.token_id)
