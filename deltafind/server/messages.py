"""POST /v1/messages: Anthropic's Messages API mapped onto the chat path (text, tool_use/tool_result, thinking).

Owns the Anthropic wire format: `system`, content blocks (text, tool_use,
tool_result, thinking) -> chat messages, `tool_choice` (auto/any/tool/none),
the answer's content blocks and stop_reason, the SSE events the anthropic SDK
parses, and Anthropic's error shape `{"type": "error", "error": {...}}`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import falcon

from deltafind.server.errors import ApiError, bad_request
from deltafind.server.items import Block, Blocks, drive
from deltafind.server.openai import (
    KEEPALIVE_S,
    Generate,
    client_gone,
    for_model,
    read_json,
    stream_sse,
)
from deltafind.server.schemas import parse_body

KNOWN = {"model", "messages", "system", "max_tokens", "tools", "tool_choice", "temperature", "top_p", "top_k", "stop_sequences",
         "stream", "metadata", "thinking", "service_tier", "container", "mcp_servers", "context_management"}
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
               413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}
STOP = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens"}


class AnthropicError(ApiError):
    def body(self) -> dict[str, Any]:
        return {"type": "error", "error": {"type": ERROR_TYPES.get(self.status, "api_error"), "message": self.message}}


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where}: expected a string or a list of content blocks", where)
    return content


def _block_text(content: Any, where: str) -> str:
    parts = []
    for j, b in enumerate(_blocks(content or "", where)):
        if not isinstance(b, dict) or b.get("type") != "text":
            raise bad_request(f"{where}[{j}]: only text blocks are supported here", f"{where}[{j}].type")
        parts.append(b.get("text") or "")
    return "".join(parts)


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat completions request equivalent to an Anthropic Messages request."""
    for key in body:
        if key not in KNOWN:
            raise bad_request(f"{key}: Extra inputs are not permitted", key)
    if not isinstance(body.get("max_tokens"), int):
        raise bad_request("max_tokens: Field required (an integer)", "max_tokens")
    msgs: list[dict[str, Any]] = []
    if body.get("system"):
        msgs.append({"role": "system", "content": _block_text(body["system"], "system")})
    for i, m in enumerate(body.get("messages") or []):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise bad_request(f"{where}.role: must be user or assistant", f"{where}.role")
        text, calls, thinking = [], [], None
        for j, b in enumerate(_blocks(m.get("content"), f"{where}.content")):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                text.append(b.get("text") or "")
            elif kind == "tool_use" and m["role"] == "assistant":
                calls.append({"id": b.get("id"), "type": "function",
                              "function": {"name": b.get("name"), "arguments": json.dumps(b.get("input") or {}, ensure_ascii=False)}})
            elif kind == "tool_result" and m["role"] == "user":
                out = b.get("content")
                msgs.append({"role": "tool", "tool_call_id": b.get("tool_use_id"),
                             "content": out if isinstance(out, str) else _block_text(out, f"{where}.content[{j}].content")})
            elif kind in ("thinking", "redacted_thinking") and m["role"] == "assistant":
                thinking = b.get("thinking")
            else:
                raise bad_request(f"{where}.content[{j}].type: {kind!r} blocks are not supported in {m['role']} messages",
                                  f"{where}.content[{j}].type")
        if text or calls or m["role"] == "assistant":
            msg: dict[str, Any] = {"role": m["role"], "content": "".join(text)}
            if calls:
                msg["tool_calls"] = calls
            if thinking:
                msg["reasoning_content"] = thinking
            msgs.append(msg)
    chat: dict[str, Any] = {"model": body.get("model"), "messages": msgs, "max_tokens": body["max_tokens"]}
    for key in ("temperature", "top_p", "stream"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("stop_sequences"):
        chat["stop"] = body["stop_sequences"]
    tools = body.get("tools") or []
    if tools:
        chat["tools"] = [{"type": "function", "function": {"name": t.get("name"), "description": t.get("description", ""),
                                                           "parameters": t.get("input_schema")}} for t in tools]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        kind = choice.get("type")
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(kind) or \
            {"type": "function", "function": {"name": choice.get("name")}}
        if choice.get("disable_parallel_tool_use"):
            chat["parallel_tool_calls"] = False
    thinking = body.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") == "disabled":
        chat["chat_template_kwargs"] = {"enable_thinking": False}
    return chat


def _content(block: Block) -> dict[str, Any]:
    if block.kind == "reasoning":
        return {"type": "thinking", "thinking": block.text, "signature": ""}
    if block.kind == "call":
        return {"type": "tool_use", "id": block.call_id.replace("call_", "toolu_"), "name": block.name,
                "input": json.loads(block.text) if block.text else {}}
    return {"type": "text", "text": block.text}


class Messages:
    def __init__(self, state: Any) -> None:
        self.state = state
        self.chat = Generate(state, chat=True)

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        try:
            self._post(req, resp)
        except ApiError as e:
            raise AnthropicError(e.status, e.message, e.param, e.code, e.headers) from None

    def _post(self, req: falcon.Request, resp: falcon.Response) -> None:
        engine = self.state.require_ready()
        chat = for_model(parse_body(to_chat(read_json(req, self.state.config.max_body_bytes)), chat=True), engine)
        choices, mux, prompt_tokens, _ = self.chat.submit(engine, chat, always_parse=True)
        c = choices[0]
        blocks = Blocks()
        shell = {"id": "msg_" + uuid.uuid4().hex[:24], "type": "message", "role": "assistant", "model": engine.model_name,
                 "stop_sequence": None}

        def usage() -> dict[str, Any]:
            return {"input_tokens": prompt_tokens - c.cached_tokens, "output_tokens": c.completion_tokens,
                    "cache_read_input_tokens": c.cached_tokens, "cache_creation_input_tokens": 0}

        def stop_reason() -> str:
            return STOP.get(c.finish_reason or "stop", "end_turn")

        if not chat.stream:
            for _ in drive(c, mux, blocks, keepalive=None, gone=lambda: client_gone(req)):
                pass
            self.state.metrics.count_completion(c.completion_tokens)
            resp.media = {**shell, "content": [_content(b) for b in blocks.blocks], "stop_reason": stop_reason(),
                          "usage": usage()}
            return

        def event(kind: str, **data: Any) -> bytes:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n".encode()

        def stream() -> Iterator[bytes]:
            yield event("message_start", message={**shell, "content": [], "stop_reason": None,
                                                   "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}})
            try:
                for batch in drive(c, mux, blocks, keepalive=KEEPALIVE_S):
                    if batch is None:
                        yield event("ping")
                        continue
                    for s in batch:
                        b = s.block
                        if s.what == "open":
                            start = _content(Block(b.kind, b.index, b.call_id, b.name))  # the block as it opens: empty
                            yield event("content_block_start", index=b.index, content_block=start)
                        elif s.what == "delta":
                            delta = ({"type": "text_delta", "text": s.text} if b.kind == "text" else
                                     {"type": "thinking_delta", "thinking": s.text} if b.kind == "reasoning" else
                                     {"type": "input_json_delta", "partial_json": s.text})
                            yield event("content_block_delta", index=b.index, delta=delta)
                        else:
                            yield event("content_block_stop", index=b.index)
            except ApiError as e:
                yield f"event: error\ndata: {json.dumps(AnthropicError(e.status, e.message).body())}\n\n".encode()
                return
            self.state.metrics.count_completion(c.completion_tokens)
            yield event("message_delta", delta={"stop_reason": stop_reason(), "stop_sequence": None}, usage=usage())
            yield event("message_stop")

        stream_sse(resp, stream())
