"""POST /v1/chat/completions and /v1/completions: validate, submit, answer or stream.

Request threads never touch tensors: they build GenRequests, submit them to the
engine client and turn the events on one shared queue into OpenAI JSON or SSE
chunks (request messages become template dicts; parsed output becomes `message`
and stream `delta`s with reasoning and tool calls). A client that goes away
closes the SSE generator; `finally` cancels its sequences, which frees their
slots at the next step.
"""

from __future__ import annotations

import json
import queue
import select
import socket
import time
import uuid
from collections.abc import Iterator
from typing import Any

import falcon
import structlog

from deltafind.engine.constraint import ConstraintFactory
from deltafind.engine.sampler import SamplingParams
from deltafind.engine.sequence import GenRequest
from deltafind.errors import RequestError
from deltafind.log import get_logger
from deltafind.server.chat_plan import plan_chat
from deltafind.server.choices import (
    Choice,
    chat_logprobs,
    completion_logprobs,
    events,
    submit_all,
    usage,
)
from deltafind.server.errors import ApiError, bad_request
from deltafind.server.output import Delta
from deltafind.server.schemas import ChatRequest, CompletionRequest, load_json, parse_body
from deltafind.server.structured import Grammar, json_schema_grammar, response_format_schema

log = get_logger(__name__)
KEEPALIVE_S = 5.0


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
        raise ApiError(413, f"the request body is {req.content_length} bytes; the limit is {limit} (server.max_body_bytes)",
                       None, "body_too_large")
    # bounded_stream reads a missing Content-Length as an empty body; the WSGI server decodes chunked itself.
    chunked = "chunked" in (req.get_header("Transfer-Encoding") or "").lower()
    try:
        raw = (req.stream if chunked else req.bounded_stream).read(limit + 1)
    except TimeoutError:
        raise ApiError(408, "the request body did not arrive in time (server.body_timeout_s); send it without pauses",
                       None, "request_timeout") from None
    except Exception as e:
        raise ApiError(400, f"the request body could not be read: {type(e).__name__}: {e}", None, "invalid_body") from None
    if len(raw) > limit:
        raise ApiError(413, f"the request body is over the limit of {limit} bytes (server.max_body_bytes)", None, "body_too_large")
    return load_json(raw)


def for_model(body: Any, engine: Any) -> Any:
    """`body` when it asks for the model served here (by its name or an alias), else a 404 naming the one that is."""
    if body.model != engine.model_name and body.model not in engine.aliases:
        raise ApiError(404, f"The model `{body.model}` does not exist; this server serves `{engine.model_name}` (GET /v1/models)",
                       "model", "model_not_found")
    return body


def stream_sse(resp: falcon.Response, events: Iterator[bytes]) -> None:
    """Answer with `events`, a not yet started generator, as a Server-Sent Events stream.

    It runs after the request's middleware is done, so it binds this request's id again for its log lines.
    """
    request_id = structlog.contextvars.get_contextvars().get("request_id")

    def run() -> Iterator[bytes]:
        structlog.contextvars.bind_contextvars(request_id=request_id)
        yield from events

    resp.content_type = "text/event-stream"
    resp.set_header("Cache-Control", "no-cache")
    resp.set_header("X-Accel-Buffering", "no")
    resp.stream = run()


def chat_messages(body: Any) -> list[dict[str, Any]]:
    """The request's messages as template dicts (`developer` is `system`; text parts joined)."""
    out = []
    for m in body.messages:
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.name:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = m.tool_calls
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if reasoning is not None:
            d["reasoning_content"] = reasoning
        out.append(d)
    return out


def chat_message(choice: Any, text: str) -> dict[str, Any]:
    """`choices[i].message` of a finished choice."""
    p = choice.parser
    if p is None:
        return {"role": "assistant", "content": text, "refusal": None}
    calls = [c.openai() for c in p.tool_calls]
    content = "".join(p.content)
    msg: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None, "refusal": None}
    if p.reasoning:
        msg["reasoning_content"] = msg["reasoning"] = "".join(p.reasoning)
    if calls:
        msg["tool_calls"] = calls
    return msg


def chunk_deltas(deltas: list[Delta]) -> list[dict[str, Any]]:
    """Stream `delta` objects for parser output: content, reasoning, a call's start, argument fragments."""
    out: list[dict[str, Any]] = []
    for d in deltas:
        if d.kind == "content":
            out.append({"content": d.text})
        elif d.kind == "reasoning":
            out.append({"reasoning_content": d.text, "reasoning": d.text})
        elif d.kind == "call":
            out.append({"tool_calls": [{"index": d.index, "id": d.call_id, "type": "function",
                                        "function": {"name": d.text, "arguments": ""}}]})
        else:
            out.append({"tool_calls": [{"index": d.index, "function": {"arguments": d.text}}]})
    return out


def completion_constraint(tokenizer: Any, body: Any) -> ConstraintFactory | None:
    """/v1/completions with `response_format`: the same enforced JSON as chat."""
    schema, field = response_format_schema(body.response_format or {})
    return None if schema is None else Grammar(tokenizer, json_schema_grammar(schema, field), field).factory()


class Generate:
    """One resource for both endpoints; `chat` picks the wire format."""

    def __init__(self, state: Any, chat: bool) -> None:
        self.state, self.chat = state, chat

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        engine = self.state.require_ready()
        body = for_model(parse_body(read_json(req, self.state.config.max_body_bytes), self.chat), engine)
        choices, mux, prompt_tokens, want_lp = self.submit(engine, body)
        meta = {"id": ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24], "created": int(time.time()),
                "model": engine.model_name}
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            stream_sse(resp, self._sse(choices, mux, meta, prompt_tokens, include_usage, want_lp is not None, engine,
                                       lambda: client_gone(req)))
            return
        started = time.monotonic()
        try:
            for _ in events(choices, mux, keepalive=None, gone=lambda: client_gone(req)):
                pass
        finally:
            for c in choices:
                c.handle.cancel()
        self.state.pace.observe(time.monotonic() - started)
        failed = next((c for c in choices if c.finish_reason == "error"), None)
        if failed is not None:
            raise failed.failure()
        self.state.metrics.count_completion(sum(c.completion_tokens for c in choices))
        resp.media = self._response(choices, meta, prompt_tokens, want_lp is not None, engine)

    def submit(self, engine: Any, body: ChatRequest | CompletionRequest, always_parse: bool = False,
               clamp: bool = False) -> tuple[list[Choice], queue.Queue, int, int | None]:
        """Build and submit a request's sequences: (choices, their event queue, prompt tokens, logprobs wanted).

        `clamp`: a token limit past the context is cut to what remains (Anthropic's clients ask for 32k-64k).
        """
        cfg = self.state.config
        plan = plan_chat(engine.tokenizer, body, chat_messages(body), always_parse) if isinstance(body, ChatRequest) else None
        turns = engine.turns if plan is not None else None
        if plan is not None:  # an answer sent back in the history keeps the ids the model generated for it
            plan.respell(engine.turns.splice(engine.tokenizer, plan.prompt_ids))
        prompts = [plan.prompt_ids] if plan is not None else self._prompts(engine, body)
        constraint = plan.constraint if plan is not None else completion_constraint(engine.tokenizer, body)
        max_context = min(cfg.max_context or engine.context_length, engine.context_length)
        gen = []
        want_lp: int | None = None
        if isinstance(body, ChatRequest) and body.logprobs:
            want_lp = body.top_logprobs or 0
        elif isinstance(body, CompletionRequest) and body.logprobs is not None:
            want_lp = body.logprobs
        for ids in prompts:
            max_new = self._max_new(body, len(ids), max_context, cfg.max_tokens_default, clamp)
            for i in range(body.n or 1):
                seed = None if body.seed is None else body.seed + i
                try:
                    params = SamplingParams(max_new, 1.0 if body.temperature is None else body.temperature,
                                            1.0 if body.top_p is None else body.top_p, body.top_k or 0, seed)
                    gen.append(GenRequest(tuple(ids), params, want_lp, body.presence_penalty or 0.0,
                                          body.frequency_penalty or 0.0, self.state.request_id(), chat=self.chat,
                                          constraint=constraint, checkpoint=plan.history_end if plan else 0))
                except RequestError as e:
                    raise bad_request(str(e), e.param, "invalid_value") from None
        mux: queue.Queue = queue.Queue()
        handles = submit_all(engine.client, gen, mux, self.state.pace)
        make_parser = plan.make_parser if plan is not None else None
        choices = [Choice(k, h, engine.tokenizer, body.stops, parser=make_parser() if make_parser else None,
                          turns=turns, prompt_ids=prompts[0] if turns is not None else ())
                   for k, h in enumerate(handles)]
        prompt_tokens = sum(len(ids) for ids in prompts)
        self.state.metrics.count_prompt(prompt_tokens)
        return choices, mux, prompt_tokens, want_lp

    # -- building blocks ------------------------------------------------------

    def _prompts(self, engine: Any, body: CompletionRequest) -> list[list[int]]:
        tok = engine.tokenizer
        out = []
        for i, p in enumerate(body.prompts()):
            if isinstance(p, str):
                ids = tok.encode(p)
                if not ids:
                    raise bad_request("prompt: the prompt is empty (no tokens)", "prompt", "invalid_value")
            else:
                bad = next((t for t in p if t >= tok.vocab_size), None)
                if bad is not None:
                    raise bad_request(f"prompt[{i}]: token id {bad} is not below the vocabulary size {tok.vocab_size}", "prompt", "invalid_value")
                ids = list(p)
            out.append(ids)
        return out

    def _max_new(self, body: ChatRequest | CompletionRequest, prompt_len: int, max_context: int, default: int | None,
                 clamp: bool = False) -> int:
        param = "messages" if self.chat else "prompt"
        asked = body.token_limit
        room = max_context - prompt_len
        if clamp and asked is not None and 0 < room < asked:
            asked = room
        if room <= 0 or (asked is not None and asked > room):
            need = prompt_len + (asked or 1)
            raise bad_request(
                f"This model's maximum context length is {max_context} tokens. However, you requested {need} tokens "
                f"({prompt_len} in the {param}, {asked or 1} in the completion). Please reduce the length of the {param} "
                "or the completion.", param, "context_length_exceeded")
        if asked is not None:
            return asked
        return room if default is None else min(default, room)  # the reference APIs: the rest of the context

    def _response(self, choices: list[Choice], meta: dict, prompt_tokens: int, want_lp: bool, engine: Any) -> dict:
        tok = engine.tokenizer
        out = []
        for c in choices:
            text = "".join(c.text)
            if self.chat:
                item = {"index": c.index, "message": chat_message(c, text),
                        "logprobs": chat_logprobs(tok, c.logprobs) if want_lp else None, "finish_reason": c.finish_reason}
            else:
                item = {"index": c.index, "text": text, "logprobs": completion_logprobs(tok, c.logprobs, 0) if want_lp else None,
                        "finish_reason": c.finish_reason}
            out.append(item)
        obj = "chat.completion" if self.chat else "text_completion"
        return {**meta, "object": obj, "choices": out, "usage": usage(choices, prompt_tokens)}

    def _sse(self, choices: list[Choice], mux: queue.Queue, meta: dict, prompt_tokens: int, include_usage: bool,
             want_lp: bool, engine: Any, gone: Any = None) -> Iterator[bytes]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        tok = engine.tokenizer
        offsets = {c.index: 0 for c in choices}

        def chunk(items: list[dict], **extra: Any) -> bytes:
            data = {**meta, "object": obj, "choices": items, **({"usage": None} if include_usage else {}), **extra}
            return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"

        def item(c: Choice, text: str | None, entries: list, finish: str | None, delta: dict | None = None) -> dict:
            if self.chat:
                delta = delta if delta is not None else {} if text is None else {"content": text}
                lp = chat_logprobs(tok, entries) if want_lp and entries else None
                return {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": finish}
            lp = completion_logprobs(tok, entries, offsets[c.index]) if want_lp and entries else None
            offsets[c.index] += len(text or "")
            return {"index": c.index, "text": text or "", "logprobs": lp, "finish_reason": finish}

        started = time.monotonic()
        try:
            if self.chat:
                for c in choices:
                    yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}])
            for ev in events(choices, mux, keepalive=KEEPALIVE_S, gone=gone):
                if ev is None:
                    yield b": keep-alive\n\n"
                    continue
                c, text, entries, done = ev
                if c.parser is not None:
                    for k, delta in enumerate(chunk_deltas(c.take_deltas()) or ([{}] if entries else [])):
                        yield chunk([item(c, None, entries if k == 0 else [], None, delta)])
                elif text or entries:
                    yield chunk([item(c, text, entries, None)])
                if done:
                    if c.finish_reason == "error":
                        err = c.failure()
                        yield b"data: " + json.dumps(err.body()).encode() + b"\n\n"
                        break
                    yield chunk([item(c, None, [], c.finish_reason)])
            if include_usage:
                data = {**meta, "object": obj, "choices": [], "usage": usage(choices, prompt_tokens)}
                yield b"data: " + json.dumps(data).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"
            self.state.metrics.count_completion(sum(c.completion_tokens for c in choices))
            self.state.pace.observe(time.monotonic() - started)
        except ApiError:  # 499 from `events`: the client hung up, nobody reads the rest
            return
        finally:
            for c in choices:
                c.handle.cancel()  # a no-op for finished ones; frees the slot of a client that left
