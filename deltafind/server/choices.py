"""From engine events to OpenAI choices: text, stop strings, logprobs, finish reasons.

One `Choice` per generated sequence. Ids become text through the tokenizer's
UTF-8-safe `IncrementalDecoder`, then a `StopMatcher` holds back what might be
the start of a stop string; a hit cancels the sequence (as vLLM's frontend does),
so a stop string never reaches the client.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from deltafind.engine.constraint import ConstraintError
from deltafind.engine.scheduler import Draining, QueueFull
from deltafind.engine.sequence import Event, FinishEvent, GenRequest, Handle, TokenEvent
from deltafind.server.errors import ApiError
from deltafind.tokenizer import StopMatcher

# Why the engine stopped -> what the client is told. A cancel we did not ask for (shutdown
# after the drain grace) says so: "length" would read as reaching max_tokens.
FINISH = {"stop": "stop", "length": "length", "cancelled": "cancelled"}
MAX_RETRY_AFTER_S = 120


@dataclass
class Choice:
    index: int
    handle: Handle
    tokenizer: Any
    stops: list[str]
    decoder: Any = None
    matcher: StopMatcher = field(init=False)
    text: list[str] = field(default_factory=list)
    logprobs: list[tuple[int, float, tuple[tuple[int, float], ...]]] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    exception: BaseException | None = None  # what failed the sequence, when it failed
    completion_tokens: int = 0
    reasoning_tokens: int = 0  # generated inside the thought (its markers included)
    cached_tokens: int = 0
    parser: Any = None  # server/output.OutputParser: reasoning and tool calls out of a chat answer
    deltas: list[Any] = field(default_factory=list)  # the parser's output not yet sent
    turns: Any = (
        None  # server/turns.TurnMemory: told the whole sequence when it ends, for the next turn
    )
    prompt_ids: Sequence[int] = ()
    ids: list[int] = field(default_factory=list)  # every token generated, even past a stop string

    def __post_init__(self) -> None:
        # A parser reads the markup (special tokens kept); the end-of-turn token is never text.
        self.decoder = self.tokenizer.decoder(skip_special_tokens=self.parser is None)
        self.matcher = StopMatcher(self.stops)
        self._eos = set(self.tokenizer.eos_token_ids) if self.parser is not None else set()

    def _parse(self, text: str, final: bool = False) -> None:
        if self.parser is not None:
            self.deltas += self.parser.feed(text)
            if final:
                self.deltas += self.parser.finish()
                if self.parser.tool_calls and self.finish_reason == "stop":
                    self.finish_reason = "tool_calls"

    def failure(self) -> ApiError:
        """The error a failed choice reports: 400 naming the field for a schema whose grammar gave up
        mid-output (the request asked for what cannot be enforced), else 500 (the engine failed)."""
        if isinstance(self.exception, ConstraintError):
            return ApiError(400, str(self.exception), self.exception.param, "invalid_schema")
        return ApiError(500, self.error or "generation failed", None, "engine_error")

    def take_deltas(self) -> list[Any]:
        out, self.deltas = self.deltas, []
        return out

    def on_event(self, event: Event) -> tuple[str, list[tuple[int, float, tuple]]]:
        """Feed one engine event; returns (text to send now, logprob entries to send now)."""
        if isinstance(event, TokenEvent):
            self.ids.append(event.token_id)
            if self.finish_reason is not None:  # stopped by a stop string; the cancel is on its way
                return "", []
            entries = [] if event.logprob is None else [(event.token_id, event.logprob, event.top)]
            piece = "" if event.token_id in self._eos else self.decoder.push(event.token_id)
            out, hit = self.matcher.push(piece)
            if hit:
                self.finish_reason = "stop"
                self.handle.cancel()
            self.text.append(out)
            thinking = self.parser is not None and self.parser.r_state == "in"
            self._parse(out, final=hit)
            if self.parser is not None and (thinking or self.parser.r_state == "in"):
                self.reasoning_tokens += 1
            self.logprobs.extend(entries)
            return out, entries
        assert isinstance(event, FinishEvent)
        self.cached_tokens, self.completion_tokens = event.cached_tokens, event.completion_tokens
        if self.turns is not None and event.reason != "error":
            self.turns.remember(self.tokenizer, [*self.prompt_ids, *self.ids])
        if self.finish_reason is not None:
            return "", []
        if event.reason == "error":
            self.error = event.error or "generation failed"
            self.exception = event.exception
            self.finish_reason = "error"
            return "", []
        out, hit = self.matcher.push(self.decoder.flush())
        out += self.matcher.flush()
        self.finish_reason = "stop" if hit else FINISH.get(event.reason, "length")
        self.text.append(out)
        self._parse(out, final=True)
        return out, []


class Pace:
    """How long requests take here (a moving average), to tell a refused client when to come back."""

    def __init__(self, weight: float = 0.2) -> None:
        self.weight = weight
        self.request_s: float | None = None
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        with self._lock:
            prev = self.request_s
            self.request_s = seconds if prev is None else prev + self.weight * (seconds - prev)

    def retry_after_s(self, running: int, waiting: int, max_running: int) -> int:
        """Seconds until the requests ahead (the queue, then this one) likely have a slot."""
        if self.request_s is None or running == 0:
            return 1
        rounds = (waiting + 1) / max(1, max_running)
        return max(1, min(MAX_RETRY_AFTER_S, math.ceil(self.request_s * rounds)))


def submit_all(engine: Any, reqs: list[GenRequest], mux: queue.Queue, pace: Pace) -> list[Handle]:
    """Submit every request or none (n > 1 and prompt lists are all-or-nothing)."""
    handles: list[Handle] = []
    try:
        for r in reqs:
            handles.append(engine.submit(r, mux))
    except (QueueFull, Draining) as e:
        for h in handles:
            h.cancel()
        if isinstance(e, Draining):
            raise ApiError(503, str(e), None, "server_draining", {"Retry-After": "5"}) from None
        st = engine.snapshot()
        retry = max(
            e.retry_after_s, pace.retry_after_s(st["running"], st["waiting"], st["max_running"])
        )
        raise ApiError(
            429,
            str(e),
            None,
            "rate_limit_exceeded",
            {"Retry-After": str(retry)},
            "rate_limit_error",
        ) from None
    return handles


def chat_logprobs(tokenizer: Any, entries: list[tuple[int, float, tuple]]) -> dict[str, Any]:
    def one(tid: int, lp: float) -> dict[str, Any]:
        text = tokenizer.decode([tid])
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {**one(t, lp), "top_logprobs": [one(a, b) for a, b in top]} for t, lp, top in entries
        ],
        "refusal": None,
    }


def completion_logprobs(
    tokenizer: Any, entries: list[tuple[int, float, tuple]], offset: int
) -> dict[str, Any]:
    tokens, lps, tops, offsets = [], [], [], []
    for t, lp, top in entries:
        text = tokenizer.decode([t])
        tokens.append(text)
        lps.append(lp)
        tops.append({tokenizer.decode([a]): b for a, b in top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def usage(choices: list[Choice], prompt_tokens: int) -> dict[str, Any]:
    completion = sum(c.completion_tokens for c in choices)
    cached = max((c.cached_tokens for c in choices), default=0)
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
    }
    if cached:
        out["prompt_tokens_details"] = {"cached_tokens": cached}
    return out
