"""POST /v1/chat/completions and /v1/completions: OpenAI's schema to and from a `RequestRun`.

Request messages become template dicts and a chat plan (or raw prompts become ids);
parsed output becomes `message` and stream `delta`s with reasoning and tool calls.
Admission, hang-ups, keep-alives, pace and metrics are lifecycle.py's.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import falcon

from deltafind.server.chat_plan import plan_chat
from deltafind.server.choices import Choice, chat_logprobs, completion_logprobs, usage
from deltafind.server.errors import ApiError, bad_request
from deltafind.server.lifecycle import AppState, ReadyEngine, RequestRun, stream_sse
from deltafind.server.output import Delta
from deltafind.server.schemas import ChatRequest, CompletionRequest, parse_body
from deltafind.server.structured import Grammar, json_schema_grammar, response_format_schema


def chat_messages(body: ChatRequest) -> list[dict[str, Any]]:
    """The request's messages as template dicts (`developer` is `system`; text parts joined)."""
    out = []
    for m in body.messages:
        d = {
            "role": "system" if m.role == "developer" else m.role,
            "content": m.text(),
            "name": m.name or None,
            "tool_calls": m.tool_calls or None,
            "tool_call_id": m.tool_call_id,
            "reasoning_content": m.reasoning
            if m.reasoning_content is None
            else m.reasoning_content,
        }
        out.append({k: v for k, v in d.items() if v is not None})  # only the fields it sets
    return out


def chat_message(choice: Choice, text: str) -> dict[str, Any]:
    """`choices[i].message` of a finished choice."""
    p = choice.parser
    if p is None:
        return {"role": "assistant", "content": text, "refusal": None}
    calls = [c.openai() for c in p.tool_calls]
    content = "".join(p.content)
    msg: dict[str, Any] = {
        "role": "assistant",
        "content": content if content or not calls else None,
        "refusal": None,
    }
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
            out.append(
                {
                    "tool_calls": [
                        {
                            "index": d.index,
                            "id": d.call_id,
                            "type": "function",
                            "function": {"name": d.text, "arguments": ""},
                        }
                    ]
                }
            )
        else:
            out.append({"tool_calls": [{"index": d.index, "function": {"arguments": d.text}}]})
    return out


class Generate:
    """One resource for both endpoints; `chat` picks the wire format."""

    def __init__(self, state: AppState, chat: bool) -> None:
        self.state, self.chat = state, chat

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        run = RequestRun(self.state, req, lambda raw: parse_body(raw, self.chat))
        engine, body = run.engine, run.body
        if isinstance(body, ChatRequest):
            run.submit(plan_chat(engine.tokenizer, body, chat_messages(body)))
        else:  # `response_format`: the same enforced JSON as chat
            schema, field = response_format_schema(body.response_format or {})
            grammar = (
                None
                if schema is None
                else Grammar(engine.tokenizer, json_schema_grammar(schema, field), field).factory()
            )
            run.submit(self._prompts(engine, body), grammar)
        meta = {
            "id": ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24],
            "created": int(time.time()),
            "model": engine.model_name,
        }
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            stream_sse(resp, self._sse(run, meta, include_usage), sse_error)
            return
        for _ in run.events(stream=False):
            pass
        resp.media = self._response(run, meta)

    def _prompts(self, engine: ReadyEngine, body: CompletionRequest) -> list[list[int]]:
        tok = engine.tokenizer
        out = []
        for i, p in enumerate(body.prompts()):
            if isinstance(p, str):
                ids = tok.encode(p)
                if not ids:
                    raise bad_request(
                        "prompt: the prompt is empty (no tokens)", "prompt", "invalid_value"
                    )
            else:
                bad = next((t for t in p if t >= tok.vocab_size), None)
                if bad is not None:
                    raise bad_request(
                        f"prompt[{i}]: token id {bad} is not below the vocabulary size {tok.vocab_size}",
                        "prompt",
                        "invalid_value",
                    )
                ids = list(p)
            out.append(ids)
        return out

    def _response(self, run: RequestRun, meta: dict) -> dict:
        tok, want_lp = run.engine.tokenizer, run.want_lp is not None
        out = []
        for c in run.choices:
            text = "".join(c.text)
            if self.chat:
                out.append(
                    {
                        "index": c.index,
                        "message": chat_message(c, text),
                        "logprobs": chat_logprobs(tok, c.logprobs) if want_lp else None,
                        "finish_reason": c.finish_reason,
                    }
                )
            else:
                out.append(
                    {
                        "index": c.index,
                        "text": text,
                        "logprobs": completion_logprobs(tok, c.logprobs, 0) if want_lp else None,
                        "finish_reason": c.finish_reason,
                    }
                )
        return {
            **meta,
            "object": "chat.completion" if self.chat else "text_completion",
            "choices": out,
            "usage": usage(run.choices, run.prompt_tokens),
        }

    def _sse(self, run: RequestRun, meta: dict, include_usage: bool) -> Iterator[bytes]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        tok, want_lp = run.engine.tokenizer, run.want_lp is not None
        offsets = {c.index: 0 for c in run.choices}

        def chunk(items: list[dict], **extra: Any) -> bytes:
            data = {
                **meta,
                "object": obj,
                "choices": items,
                **({"usage": None} if include_usage else {}),
                **extra,
            }
            return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"

        def item(
            c: Choice,
            text: str | None,
            entries: list,
            finish: str | None,
            delta: dict | None = None,
        ) -> dict:
            if self.chat:
                delta = delta if delta is not None else {} if text is None else {"content": text}
                lp = chat_logprobs(tok, entries) if want_lp and entries else None
                return {"index": c.index, "delta": delta, "logprobs": lp, "finish_reason": finish}
            lp = (
                completion_logprobs(tok, entries, offsets[c.index]) if want_lp and entries else None
            )
            offsets[c.index] += len(text or "")
            return {"index": c.index, "text": text or "", "logprobs": lp, "finish_reason": finish}

        if self.chat:
            for c in run.choices:
                yield chunk(
                    [
                        {
                            "index": c.index,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                )
        for ev in run.events(stream=True):
            if ev is None:
                yield b": keep-alive\n\n"
                continue
            c, text, entries, done = ev
            if c.parser is not None:
                for k, delta in enumerate(
                    chunk_deltas(c.take_deltas()) or ([{}] if entries else [])
                ):
                    yield chunk([item(c, None, entries if k == 0 else [], None, delta)])
            elif text or entries:
                yield chunk([item(c, text, entries, None)])
            if done:
                yield chunk([item(c, None, [], c.finish_reason)])
        if include_usage:
            yield chunk([], usage=usage(run.choices, run.prompt_tokens))
        yield b"data: [DONE]\n\n"


def sse_error(e: ApiError) -> bytes:
    """A stream's error in OpenAI's shape, then the end of the stream (as vLLM sends it)."""
    return b"data: " + json.dumps(e.body()).encode() + b"\n\ndata: [DONE]\n\n"
