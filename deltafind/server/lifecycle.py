"""One request's lifecycle, the same on every generating endpoint: admission, its events, its end.

`RequestRun` admits a request (model loaded, body within the limit, parsed, this model named),
submits its sequences (429/503 when full or draining), runs their events with a poll for a client
that hung up (slots freed within a second) and a keep-alive every KEEPALIVE_S when streamed, then
cancels what is left and records pace and metrics. openai.py, messages.py and responses.py only
translate their schema to and from it.
"""

from __future__ import annotations

import queue
import select
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import falcon
import structlog

from deltafind.engine.constraint import ConstraintFactory
from deltafind.engine.sampler import SamplingParams
from deltafind.engine.scheduler import Scheduler
from deltafind.engine.sequence import FinishEvent, GenRequest
from deltafind.errors import RequestError
from deltafind.log import get_logger
from deltafind.server.chat_plan import ChatPlan
from deltafind.server.choices import Choice, Pace, submit_all
from deltafind.server.errors import ApiError, bad_request
from deltafind.server.metrics import ServerMetrics
from deltafind.server.schemas import ChatRequest, CompletionRequest, load_json
from deltafind.server.turns import TurnMemory
from deltafind.tokenizer import Tokenizer

KEEPALIVE_S = (
    5.0  # a silent stream is timed out by clients and proxies: a ping or SSE comment this often
)
POLL_S = (
    0.5  # how often a request looks for a client that hung up: its slot is freed within a second
)
Body = TypeVar("Body", bound=ChatRequest | CompletionRequest)
log = get_logger(__name__)


@dataclass(frozen=True)
class ServerConfig:
    """The live-reloadable part of `[server]` the app reads on every request."""

    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 1 << 20
    max_tokens_default: int | None = None  # None: the rest of the context
    max_context: int | None = None
    # a request's omitted temperature, top_p, top_k (None: the model's generation_config.json)
    temperature_default: float | None = None
    top_p_default: float | None = None
    top_k_default: int | None = None


@dataclass
class ReadyEngine:
    client: Scheduler  # the engine as the server sees it: submit, snapshot, draining
    tokenizer: Tokenizer
    model_name: str
    context_length: int
    created: int = field(default_factory=lambda: int(time.time()))
    store_snapshot: Callable[[], dict[str, Any]] = field(
        default=lambda: {}
    )  # the store's figures, for /metrics
    nodes: Callable[[], list[dict[str, Any]]] = field(
        default=list
    )  # a cluster's expert nodes (cheap: /health asks)
    drive_problems: Callable[[], list[str]] = field(
        default=list
    )  # unhealthy drives, each named (cheap: /health asks)
    turns: TurnMemory = field(
        default_factory=TurnMemory
    )  # finished answers' ids, so the next turn's prompt reuses them
    aliases: tuple[str, ...] = ()  # [server] model_aliases: other names the model answers to


class AppState:
    """What the app reads per request; the daemon swaps `config` on reload and sets `engine` once loaded."""

    def __init__(self, config: ServerConfig | None = None, model_name: str = "") -> None:
        self.config = config or ServerConfig()
        self.model_name = model_name
        self.engine: ReadyEngine | None = None
        self.load_status = "loading"  # loading | failed | ready
        self.load_error: str | None = None
        self.metrics = ServerMetrics()
        self.pace = Pace()  # request durations, for Retry-After

    def set_ready(self, engine: ReadyEngine) -> None:
        self.engine, self.load_status = engine, "ready"

    def set_failed(self, message: str) -> None:
        self.load_status, self.load_error = "failed", message

    def require_ready(self) -> ReadyEngine:
        if self.engine is None:
            if self.load_status == "failed":
                raise ApiError(
                    503, f"the model failed to load: {self.load_error}", None, "model_load_failed"
                )
            raise ApiError(
                503,
                "the model is loading; retry shortly",
                None,
                "model_loading",
                {"Retry-After": "5"},
            )
        return self.engine


def client_gone(req: falcon.Request) -> bool:
    """Whether the client closed its connection (readable with nothing to read); False when unknown."""
    sock = req.env.get("gunicorn.socket")
    if not isinstance(sock, socket.socket) or sock.fileno() < 0:
        return False
    try:
        if not select.select([sock], [], [], 0)[0]:
            return False
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:  # reset by the peer
        return True


def read_json(req: falcon.Request, limit: int) -> dict[str, Any]:
    """The request body as a JSON object, at most `limit` bytes: a Content-Length body or a chunked one.

    A body that stops arriving raises the socket timeout the daemon's worker sets
    (server.body_timeout_s), answered 408; a client that hangs up mid-body, 400.
    """
    if req.content_length is not None and req.content_length > limit:
        raise ApiError(
            413,
            f"the request body is {req.content_length} bytes; the limit is {limit} (server.max_body_bytes)",
            None,
            "body_too_large",
        )
    # bounded_stream reads a missing Content-Length as an empty body; the WSGI server decodes chunked itself.
    chunked = "chunked" in (req.get_header("Transfer-Encoding") or "").lower()
    try:
        raw = (req.stream if chunked else req.bounded_stream).read(limit + 1)
    except TimeoutError:
        raise ApiError(
            408,
            "the request body did not arrive in time (server.body_timeout_s); send it without pauses",
            None,
            "request_timeout",
        ) from None
    except Exception as e:
        raise ApiError(
            400,
            f"the request body could not be read: {type(e).__name__}: {e}",
            None,
            "invalid_body",
        ) from None
    if len(raw) > limit:
        raise ApiError(
            413,
            f"the request body is over the limit of {limit} bytes (server.max_body_bytes)",
            None,
            "body_too_large",
        )
    return load_json(raw)


def stream_sse(
    resp: falcon.Response, events: Iterator[bytes], error: Callable[[ApiError], bytes]
) -> None:
    """Answer with `events`, a not yet started generator, as a Server-Sent Events stream.

    An ApiError it raises ends the stream with `error(e)`, the event in the endpoint's API's shape; a
    client that hung up (499) is told nothing. It runs after the request's middleware is done, so it
    binds this request's id again for its log lines.
    """
    request_id = structlog.contextvars.get_contextvars().get("request_id")

    def run() -> Iterator[bytes]:
        structlog.contextvars.bind_contextvars(request_id=request_id)
        try:
            yield from events
        except ApiError as e:
            if e.status != 499:
                yield error(e)

    resp.content_type = "text/event-stream"
    resp.set_header("Cache-Control", "no-cache")
    resp.set_header("X-Accel-Buffering", "no")
    resp.stream = run()


class RequestRun(Generic[Body]):
    """One request from admission to its sequences' end, whatever API it came in by."""

    def __init__(
        self, state: AppState, req: falcon.Request, parse: Callable[[dict[str, Any]], Body]
    ) -> None:
        """Admit `req`: a loaded model, a JSON body within the limit that `parse` takes, for the model served here."""
        self.state, self.req, self.engine = state, req, state.require_ready()
        self.raw = read_json(req, state.config.max_body_bytes)
        self.body = parse(self.raw)
        # the model served here, by its name or an alias; else a 404 naming the one that is
        if self.body.model != self.engine.model_name and self.body.model not in self.engine.aliases:
            raise ApiError(
                404,
                f"The model `{self.body.model}` does not exist; this server serves "
                f"`{self.engine.model_name}` (GET /v1/models)",
                "model",
                "model_not_found",
            )
        self.mux: queue.Queue = queue.Queue()
        self.choices: list[Choice] = []
        self.prompt_tokens = 0
        self.want_lp: int | None = (
            None  # top logprobs asked for (0: the chosen token's only); None: none
        )
        if isinstance(self.body, ChatRequest) and self.body.logprobs:
            self.want_lp = self.body.top_logprobs or 0
        elif isinstance(self.body, CompletionRequest) and self.body.logprobs is not None:
            self.want_lp = self.body.logprobs

    def submit(
        self,
        prompts: ChatPlan | list[list[int]],
        constraint: ConstraintFactory | None = None,
        clamp: bool = False,
    ) -> list[Choice]:
        """Submit a chat plan's prompt, or raw prompts, `n` times each: all of them or none.

        `clamp`: a token limit past the context is cut to what remains (Anthropic's clients ask for 32k-64k).
        """
        engine, body, cfg = self.engine, self.body, self.state.config
        plan = prompts if isinstance(prompts, ChatPlan) else None
        # an answer sent back in the history keeps the ids the model generated for it
        if plan is not None:
            plan.respell(engine.turns.splice(engine.tokenizer, plan.prompt_ids))
            prompts, constraint = [plan.prompt_ids], plan.constraint
        max_context = min(cfg.max_context or engine.context_length, engine.context_length)
        temperature, top_p, top_k = self._sampling(cfg, engine.tokenizer.sampling_defaults)
        gen = []
        for ids in prompts:
            max_new = self._max_new(len(ids), max_context, cfg.max_tokens_default, clamp)
            for i in range(body.n or 1):
                seed = None if body.seed is None else body.seed + i
                try:
                    params = SamplingParams(max_new, temperature, top_p, top_k, seed)
                    gen.append(
                        GenRequest(
                            tuple(ids),
                            params,
                            self.want_lp,
                            body.presence_penalty or 0.0,
                            body.frequency_penalty or 0.0,
                            self.req.context.request_id,  # set by app.RequestContext
                            chat=plan is not None,
                            constraint=constraint,
                            checkpoint=plan.history_end if plan else 0,
                        )
                    )
                except RequestError as e:
                    raise bad_request(str(e), e.param, "invalid_value") from None
        handles = submit_all(engine.client, gen, self.mux, self.state.pace)
        turns = engine.turns if plan is not None else None
        self.choices = [
            Choice(
                k,
                h,
                engine.tokenizer,
                body.stops,
                parser=plan.make_parser() if plan and plan.make_parser else None,
                turns=turns,
                prompt_ids=prompts[0] if turns is not None else (),
            )
            for k, h in enumerate(handles)
        ]
        self.prompt_tokens = sum(len(ids) for ids in prompts)
        self.state.metrics.count_tokens(prompt=self.prompt_tokens)
        return self.choices

    def _sampling(self, cfg: ServerConfig, model: dict[str, Any]) -> tuple[float, float, int]:
        """The request's temperature, top_p and top_k; where it sets none, `[server]`'s default, then
        the model's generation_config.json, then the reference APIs' (1.0, 1.0, off)."""
        body = self.body

        def pick(asked: Any, configured: Any, name: str, api: float) -> Any:
            return next((v for v in (asked, configured, model.get(name)) if v is not None), api)

        return (
            pick(body.temperature, cfg.temperature_default, "temperature", 1.0),
            pick(body.top_p, cfg.top_p_default, "top_p", 1.0),
            pick(body.top_k, cfg.top_k_default, "top_k", 0) or 0,
        )

    def _max_new(self, prompt_len: int, max_context: int, default: int | None, clamp: bool) -> int:
        param = "messages" if isinstance(self.body, ChatRequest) else "prompt"
        asked = self.body.token_limit
        room = max_context - prompt_len
        if clamp and asked is not None and 0 < room < asked:
            asked = room
        if room <= 0 or (asked is not None and asked > room):
            need = prompt_len + (asked or 1)
            raise bad_request(
                f"This model's maximum context length is {max_context} tokens. However, you requested {need} tokens "
                f"({prompt_len} in the {param}, {asked or 1} in the completion). Please reduce the length of the {param} "
                "or the completion.",
                param,
                "context_length_exceeded",
            )
        if asked is not None:
            return asked
        return (
            room if default is None else min(default, room)
        )  # the reference APIs: the rest of the context

    def events(self, stream: bool) -> Iterator[tuple[Choice, str, list, bool] | None]:
        """(choice, text, logprob entries, finished) per engine event until every choice has finished; None
        when KEEPALIVE_S passed quietly (streamed only).

        Whether the client hung up is asked every POLL_S, also while the prompt waits for a slot or prefills
        (nothing is written then, so nothing else would notice): a yes raises ApiError 499. Else the failed
        choice's own error (400 for a schema that gave up mid-output, 500 when the engine failed); at any end
        the sequences left are cancelled (a no-op for finished ones; frees the slots of a client that left).
        """
        started = quiet_since = next_poll = time.monotonic()
        by_seq = {c.handle.seq_id: c for c in self.choices}
        keepalive, open_ = KEEPALIVE_S if stream else None, len(self.choices)
        try:
            while open_:
                try:
                    seq_id, event = self.mux.get(timeout=min(POLL_S, keepalive or POLL_S))
                except queue.Empty:
                    event = None
                now = time.monotonic()
                # by the clock: a fast model never leaves the queue quiet
                if now >= next_poll:
                    next_poll = now + POLL_S
                    if client_gone(self.req):
                        log.info("client_gone", choices=len(self.choices))
                        raise ApiError(
                            499,
                            "the client closed the connection before the answer was ready",
                            None,
                            "client_closed_request",
                        )
                if event is None:
                    if keepalive is not None and now - quiet_since >= keepalive:
                        quiet_since = now
                        yield None
                    continue
                quiet_since, c = now, by_seq[seq_id]
                text, entries = c.on_event(event)
                done = isinstance(event, FinishEvent)
                if done and c.finish_reason == "error":
                    raise c.failure()  # 400 for a schema that gave up mid-output, else 500
                open_ -= done
                yield c, text, entries, done
        finally:
            for c in self.choices:
                c.handle.cancel()
        self.state.pace.observe(time.monotonic() - started)
        self.state.metrics.count_tokens(completion=sum(c.completion_tokens for c in self.choices))
