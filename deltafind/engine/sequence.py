"""One generation request inside the engine: its tokens, cache, sampler, constraint and event queue.

The engine core owns `Sequence` objects; request threads hold only the `Handle`,
which reads events back and can cancel. Speaks token ids only, never text.
"""

from __future__ import annotations

import queue
import threading
from collections import Counter
from collections.abc import Iterator
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass, field
from typing import Any

import torch

from deltafind.engine.constraint import Constraint, ConstraintFactory
from deltafind.engine.constraint import apply as apply_constraint
from deltafind.engine.sampler import SamplingParams, make_generator, make_sampler
from deltafind.errors import RequestError
from deltafind.models.ops.batch import SequenceCache


@dataclass(frozen=True)
class GenRequest:
    """What a client asks the engine for, in ids.

    Args:
        logprobs: None = no logprobs; N >= 0 = the chosen token's logprob plus
            the N most likely alternatives at each step.
        presence_penalty, frequency_penalty: OpenAI's, subtracted from the logits
            of tokens already generated (once, and once per occurrence).
        checkpoint: prompt tokens after which the prefill ends a chunk and the prefix
            cache keeps a copy of the cache (where a chat's history ends); 0: none.
    """

    prompt_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    request_id: str = ""
    chat: bool = False  # a chat turn: raw-only drafts (cross-tokenizer, docs/kimi-k3-drafting-io.md §7.7) stay off
    constraint: ConstraintFactory | None = field(
        default=None, compare=False
    )  # structured output, one per sequence
    checkpoint: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise RequestError("the prompt must have at least one token", "prompt")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise RequestError(f"logprobs must be in [0, 20] (got {self.logprobs})", "top_logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise RequestError(f"{name} must be in [-2, 2] (got {getattr(self, name)})", name)
        if not 0 <= self.checkpoint < len(self.prompt_ids):
            raise RequestError(
                f"checkpoint must be in [0, {len(self.prompt_ids)}) (got {self.checkpoint})",
                "checkpoint",
            )


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] = ()  # most likely alternatives, best first


@dataclass(frozen=True)
class FinishEvent:
    """The last event of every sequence. reason: stop | length | cancelled | error."""

    reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None
    exception: BaseException | None = field(
        default=None, compare=False, repr=False
    )  # re-raised by a synchronous caller


Event = TokenEvent | FinishEvent


class Handle:
    """A request thread's end of one sequence: events in order, then one FinishEvent."""

    def __init__(
        self, seq_id: int, on_cancel: object, mux: queue.Queue[tuple[int, Event]] | None = None
    ) -> None:
        self.seq_id = seq_id
        self.events: queue.Queue[Event] = queue.Queue()
        self._mux = mux
        self._cancel = threading.Event()
        self._on_cancel = on_cancel
        self.finish: FinishEvent | None = None

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def cancel(self) -> None:
        """Stop this sequence at the next step boundary (idempotent; safe from any thread)."""
        if not self._cancel.is_set():
            self._cancel.set()
            self._on_cancel()  # type: ignore[operator]

    def put(self, event: Event) -> None:
        """Deliver an event (engine thread): to this handle, or as (seq_id, event) to the shared queue."""
        if isinstance(event, FinishEvent):
            self.finish = event
        if self._mux is not None:
            self._mux.put((self.seq_id, event))
        else:
            self.events.put(event)

    def get(self, timeout: float | None = None) -> Event | None:
        """The next event, or None after `timeout` seconds without one."""
        try:
            event = self.events.get(timeout=timeout)
        except queue.Empty:
            return None
        return event

    def __iter__(self) -> Iterator[Event]:
        while True:
            event = self.get()
            assert event is not None
            yield event
            if isinstance(event, FinishEvent):
                return


class Sequence:
    """Engine-side state of one request (the core owns it; per-step scratch lives in the core's StepPlan)."""

    def __init__(self, seq_id: int, req: GenRequest, eos_token_ids: set[int], max_len: int) -> None:
        self.seq_id, self.req = seq_id, req
        self.tokens: list[int] = list(req.prompt_ids)
        self.num_prompt = len(req.prompt_ids)
        self.num_computed = 0  # tokens already fed to the model (the cache holds them)
        self.cached_tokens = 0
        self.cache: SequenceCache | None = None
        self.states: dict[
            int, list[Any]
        ] = {}  # prompt position -> recurrent state snapshot (engine/prefix_cache)
        self.generator = make_generator(req.params)  # the sampler's and the verifier's draws
        self.sample = make_sampler(req.params, self.generator)
        self.drafter: Any = None  # engine/speculative.Drafter while this sequence drafts
        self.constraint: Constraint | None = None
        self.counts: Counter[int] = Counter()
        p = req.params
        self.stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else eos_token_ids)
        self.max_new = min(p.max_new_tokens, max(0, max_len - self.num_prompt))
        self.finished: str | None = None
        self.error: str | None = None
        self.exception: BaseException | None = None
        self.submitted_at = 0.0  # time.monotonic() stamps, for the latency histograms
        self.last_token_at: float | None = None

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def pending(self) -> int:
        """Tokens known but not yet fed to the model (prompt rest in prefill, 1 in decode)."""
        return len(self.tokens) - self.num_computed

    def start_constraint(self) -> None:
        if self.req.constraint is not None:
            self.constraint = self.req.constraint()

    def choose(self, logits: torch.Tensor) -> TokenEvent:
        """Sample the next token from this step's last-token logits [V] and record it."""
        return self.record(
            self.sample(apply_constraint(self.scores(logits), self.constraint)), logits
        )

    def scores(self, logits: torch.Tensor, after: Sequence_[int] = ()) -> torch.Tensor:
        """The logits [V] the sampler sees: penalties for tokens generated so far (plus `after`)."""
        req = self.req
        scores = logits.float()
        counts = self.counts + Counter(after) if after else self.counts
        if counts and (req.presence_penalty or req.frequency_penalty):
            ids = torch.tensor(list(counts), dtype=torch.long, device=scores.device)
            n = torch.tensor(list(counts.values()), dtype=scores.dtype, device=scores.device)
            scores = scores.clone()
            scores[ids] -= req.presence_penalty + req.frequency_penalty * n
        return scores

    def verify_rows(
        self,
        logits: torch.Tensor,
        tokens: list[int],
        q: torch.Tensor | None,
    ) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
        """The scores [k+1, V] the verifier sees for `[pending, *tokens]`, and the drafts it may accept.

        Row i carries the penalties of the drafts before it and the constraint's mask after
        them. A draft the mask forbids is kept (the verifier rejects it: p = 0 there) and the
        drafts after it dropped; the constraint is rolled back to where it was.
        """
        c, rows, advanced = self.constraint, [], 0
        try:
            for i in range(len(tokens) + 1):
                rows.append(apply_constraint(self.scores(logits[i], tokens[:i]), c))
                if c is not None and i < len(tokens):
                    if not c.advance(tokens[i]):
                        rows.append(
                            self.scores(logits[i + 1], tokens[: i + 1])
                        )  # never read: tokens[i] is rejected
                        tokens = tokens[: i + 1]
                        q = None if q is None else q[: i + 1]
                        break
                    advanced += 1
        finally:
            if c is not None and advanced:
                c.rollback(advanced)
        return torch.stack(rows), tokens, q

    def record(self, token: int, logits: torch.Tensor) -> TokenEvent:
        """Append a chosen token (sampled here, or emitted by the verifier) and check for the end."""
        req = self.req
        if self.constraint is not None and not self.constraint.advance(token):
            raise RequestError(
                f"the output constraint refused token {token}, which it had allowed",
                "response_format",
            )
        event = TokenEvent(token)
        if req.logprobs is not None:
            # Logprobs of the model's distribution (before penalties and temperature), as OpenAI reports.
            lp = torch.log_softmax(logits.float(), dim=-1)
            top: tuple[tuple[int, float], ...] = ()
            if req.logprobs:
                vals, idx = torch.topk(lp, min(req.logprobs, lp.shape[-1]))
                top = tuple(zip(idx.tolist(), vals.tolist(), strict=True))
            event = TokenEvent(token, float(lp[token]), top)
        self.tokens.append(token)
        self.counts[token] += 1
        if token in self.stop_ids or (self.constraint is not None and self.constraint.done):
            self.finished = "stop"
        elif self.num_generated >= self.max_new:
            self.finished = "length"
        return event

    def finish_event(self, reason: str, error: str | None = None) -> FinishEvent:
        return FinishEvent(
            reason, self.num_prompt, self.num_generated, self.cached_tokens, error, self.exception
        )
