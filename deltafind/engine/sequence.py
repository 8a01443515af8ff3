"""One generation request inside the engine: its tokens, cache, sampler and event queue.

The scheduler owns `Sequence` objects; request threads hold only the `Handle`,
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

from deltafind.engine import constraint as constraints  # constraint hook (agents branch)
from deltafind.engine.constraint import ConstraintFactory  # constraint hook (agents branch)
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
    """

    prompt_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    request_id: str = ""
    chat: bool = False  # a chat turn: raw-only drafts (cross-tokenizer, spec 7.7) stay off
    constraint: ConstraintFactory | None = field(default=None, compare=False)  # constraint hook (agents branch)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise RequestError("the prompt must have at least one token", "prompt")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise RequestError(f"logprobs must be in [0, 20] (got {self.logprobs})", "top_logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise RequestError(f"{name} must be in [-2, 2] (got {getattr(self, name)})", name)


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


Event = TokenEvent | FinishEvent


class Handle:
    """A request thread's end of one sequence: events in order, then one FinishEvent."""

    def __init__(self, seq_id: int, on_cancel: object, mux: queue.Queue[tuple[int, Event]] | None = None) -> None:
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
    """Engine-side state of one request."""

    def __init__(self, seq_id: int, req: GenRequest, handle: Handle, eos_token_ids: set[int], max_len: int) -> None:
        self.seq_id, self.req, self.handle = seq_id, req, handle
        self.tokens: list[int] = list(req.prompt_ids)
        self.num_prompt = len(req.prompt_ids)
        self.num_computed = 0  # tokens already fed to the model (the cache holds them)
        self.cached_tokens = 0
        self.cache: SequenceCache | None = None
        self.generator = make_generator(req.params)  # the sampler's and the verifier's draws
        self.sample = make_sampler(req.params, self.generator)
        self.drafter: Any = None  # engine/speculative.Drafter while this sequence drafts
        self.proposal: Any = None  # this step's draft Proposal, if any
        self.draft_s = 0.0  # this step's drafting time
        self.emitted = 1  # tokens this step emitted
        self.step_base = 0  # num_computed when this step was planned
        self.counts: Counter[int] = Counter()
        p = req.params
        self.stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else eos_token_ids)
        self.max_new = min(p.max_new_tokens, max(0, max_len - self.num_prompt))
        self.finished: str | None = None
        self.constraint = req.constraint() if req.constraint is not None else None  # constraint hook (agents branch)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def pending(self) -> int:
        """Tokens known but not yet fed to the model (prompt rest in prefill, 1 in decode)."""
        return len(self.tokens) - self.num_computed

    def choose(self, logits: torch.Tensor) -> TokenEvent:
        """Sample the next token from this step's last-token logits [V] and record it."""
        return self.record(self.sample(self.scores(logits)), logits)

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
        if self.constraint is not None:  # constraint hook (agents branch): the mask after `after` (drafts)
            took = 0  # constraint hook (agents branch)
            for t in after:  # constraint hook (agents branch)
                if not self.constraint.advance(t):  # constraint hook (agents branch): a forbidden draft
                    break  # constraint hook (agents branch): rejected at its own row; this row is moot
                took += 1  # constraint hook (agents branch)
            scores = constraints.apply(scores, self.constraint)  # constraint hook (agents branch)
            self.constraint.rollback(took)  # constraint hook (agents branch)
        return scores

    def record(self, token: int, logits: torch.Tensor) -> TokenEvent:
        """Append a chosen token (sampled here, or emitted by the verifier) and check for the end."""
        req = self.req
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
        if self.constraint is not None and not self.constraint.advance(token):  # constraint hook (agents branch)
            self.finished = "error"  # constraint hook (agents branch): a token the mask forbade got through
        elif token in self.stop_ids:
            self.finished = "stop"
        elif self.constraint is not None and self.constraint.done:  # constraint hook (agents branch)
            self.finished = "stop"  # constraint hook (agents branch)
        elif self.num_generated >= self.max_new:
            self.finished = "length"
        return event

    def finish_event(self, reason: str, error: str | None = None) -> FinishEvent:
        return FinishEvent(reason, self.num_prompt, self.num_generated, self.cached_tokens, error)
