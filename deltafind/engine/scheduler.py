"""Continuous batching for the daemon: one engine thread steps the `EngineCore` for every request.

Request threads `submit` a `GenRequest` and read `TokenEvent`s back from their
`Handle`; the engine thread hands new requests and cancellations to the core
between steps, runs `core.step()` (one forward over all running sequences, see
engine/core.py) and delivers its events. Knows nothing of HTTP or text; the
server cancels a handle to stop a sequence.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from deltafind.engine.core import EngineCore
from deltafind.engine.draft.policy import PolicyOptions
from deltafind.engine.sequence import Event, FinishEvent, GenRequest, Handle
from deltafind.engine.stats import EngineStats
from deltafind.engine.step import Events, SchedulerLimits
from deltafind.errors import DeltafindError
from deltafind.log import get_logger

log = get_logger(__name__)
__all__ = ["Draining", "QueueFull", "Scheduler", "SchedulerLimits", "collect"]


class QueueFull(DeltafindError):
    """Every slot is busy and the wait queue is full; retry later (HTTP 429)."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Draining(DeltafindError):
    """The engine takes no new requests (drain or shutdown; HTTP 503)."""


class Scheduler:
    """Owns the model's forward passes; all other threads talk through submit/cancel/status."""

    def __init__(
        self,
        net: Any,
        eos_token_ids: Sequence[int] = (),
        limits: SchedulerLimits | None = None,
        draft: Any = None,
        draft_policy: PolicyOptions | None = None,
    ) -> None:
        """`draft` (a `DraftSource`) turns on speculative decoding under `draft_policy`."""
        self.core = EngineCore(net, eos_token_ids, limits, draft, draft_policy)
        self._cv = threading.Condition()
        self._incoming: deque[tuple[int, GenRequest, float]] = deque()
        self._handles: dict[int, Handle] = {}
        self._calls: list[Callable[[], None]] = []
        self._ids = itertools.count()
        self._draining = False
        self._stopped = False
        self._recent: deque[tuple[float, int]] = (
            deque()
        )  # (time, tokens) of recent steps, for tok/s
        self._thread = threading.Thread(target=self._loop, name="deltafind-engine", daemon=True)
        self._thread.start()

    @property
    def stats(self) -> EngineStats:
        return self.core.stats

    @property
    def alive(self) -> bool:
        """The engine thread runs (the watchdog's health check)."""
        return self._thread.is_alive()

    # -- the request side -----------------------------------------------------

    def submit(self, req: GenRequest, mux: queue.Queue[tuple[int, Event]] | None = None) -> Handle:
        """Queue a request; raises QueueFull (wait queue full) or Draining.

        With `mux`, events go there as (handle.seq_id, event), so one reader can follow
        several sequences (n > 1) without polling.
        """
        with self._cv:
            if self._draining or self._stopped:
                raise Draining(
                    "the server is draining and takes no new requests; retry on another instance or later"
                )
            running, waiting = self._counts()
            lim = self.core.limits
            if waiting >= lim.max_queue + max(0, lim.max_running - running):
                raise QueueFull(
                    f"the server is busy ({running} running, {waiting} waiting); retry shortly"
                )
            seq_id = next(self._ids)
            handle = Handle(seq_id, self._wake, mux)
            self._handles[seq_id] = handle
            self._incoming.append((seq_id, req, time.monotonic()))
            self._cv.notify_all()
            return handle

    def _counts(self) -> tuple[int, int]:
        return len(self.core.running), len(self.core.waiting) + len(self._incoming)

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

        def apply() -> None:
            self.core.limits = limits
            self.core.prefix.resize(limits.prompt_bytes)

        self.call_soon(apply)

    def configure_draft(self, policy: PolicyOptions | None, enabled: bool = True) -> None:
        """New draft policy (reload): sequences admitted from now on use it; False stops drafting."""

        def apply() -> None:
            if policy is not None:
                self.core.draft_policy = policy
            self.core.draft_enabled = enabled

        self.call_soon(apply)

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
            handles = list(self._handles.values())
        for h in handles:
            h.cancel()
        return len(handles)

    @property
    def num_active(self) -> int:
        with self._cv:
            return len(self._handles)

    def snapshot(self) -> dict[str, Any]:
        """The engine's figures as JSON-ready data (status --json, bench --json, --stats, /metrics)."""
        with self._cv:
            now = time.monotonic()
            while self._recent and self._recent[0][0] < now - 10.0:
                self._recent.popleft()
            span = now - self._recent[0][0] if self._recent else 0.0
            tokens = sum(n for _, n in self._recent)
            running, waiting = self._counts()
            c, lim = self.core, self.core.limits
            return {
                "running": running,
                "waiting": waiting,
                "draining": self._draining,
                "tok_s": tokens / span if span > 0.5 else 0.0,
                "max_running": lim.max_running,
                "max_queue": lim.max_queue,
                "prefix_hits": c.prefix.hits,
                "prefix_misses": c.prefix.misses,
                "prefix_bytes": c.prefix.used_bytes,
                "prefix_reused_tokens": c.prefix.reused_tokens,
                # the next prefill chunk by the step time target (None: no target)
                "prefill_chunk_tokens": c.budget.prefill_tokens(),
                "step_target_s": c.budget.target_s,
                "draft_source": getattr(c.draft, "name", "") or "",
                "draft_mode": c.draft_policy.mode
                if c.draft is not None and c.draft_enabled
                else "off",
                **c.stats.snapshot(),
            }

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
        core = self.core
        while True:
            with self._cv:
                while not (self._stopped or self._calls or self._incoming or core.has_work):
                    self._cv.wait()
                calls, self._calls = self._calls, []
                for seq_id, req, t in self._incoming:
                    core.add(req, seq_id, t)
                self._incoming.clear()
                cancelled = {i for i, h in self._handles.items() if h.cancelled}
                if self._stopped and not calls:
                    self._deliver(core.abort(set(self._handles)))
                    return
            for fn in calls:
                try:
                    fn()
                except Exception:  # a call's failure is the caller's; the engine goes on
                    log.exception("engine_call_failed")
            events = core.abort(cancelled) if cancelled else []
            if core.has_work:
                stepped = core.step()
                with self._cv:
                    self._recent.append(
                        (time.monotonic(), sum(not isinstance(e, FinishEvent) for _, e in stepped))
                    )
                events += stepped
            self._deliver(events)

    def _deliver(self, events: Events) -> None:
        with self._cv:
            for seq_id, event in events:
                handle = self._handles.get(seq_id)
                if handle is None:
                    continue
                handle.put(event)
                if isinstance(event, FinishEvent):
                    del self._handles[seq_id]


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
