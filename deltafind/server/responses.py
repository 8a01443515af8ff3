"""POST /v1/responses: OpenAI's Responses API mapped onto the chat path (text, function tools, streaming).

Owns the Responses wire format: `input` items and `instructions` -> chat
messages, `text.format` -> response_format, output items (reasoning, message,
function_call) and the streaming events the openai SDK parses. `previous_response_id`
continues a conversation this process answered (kept in memory, newest 256).
Errors are OpenAI-shaped, as on the other /v1 routes.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import falcon

from deltafind.server.errors import ApiError, bad_request
from deltafind.server.items import Block, Blocks, Step, drive
from deltafind.server.openai import KEEPALIVE_S, Generate, for_model, read_json, stream_sse
from deltafind.server.schemas import parse_body

PASSED = {"model", "temperature", "top_p", "stream", "parallel_tool_calls", "user", "metadata", "tool_choice"}
# Accepted and without effect here (storage, tracing, caching hints).
IGNORED = {"store", "include", "truncation", "service_tier", "prompt_cache_key", "safety_identifier", "background",
           "stream_options", "max_tool_calls", "prompt_cache_retention", "top_logprobs", "conversation", "prompt"}
KNOWN = PASSED | IGNORED | {"input", "instructions", "tools", "max_output_tokens", "text", "reasoning", "previous_response_id"}
MAX_KEPT = 256


def _text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_request(f"{where}: expected a string or a list of text parts", where, "invalid_value")
    out = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text", "refusal"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(f"{where}[{j}]: {kind!r} content is not supported (text only)", f"{where}[{j}].type",
                              "unsupported_content")
        out.append(part.get("text") or part.get("refusal") or "")
    return "".join(out)


def to_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """`instructions` and `input` items as chat messages (calls joined onto their assistant turn)."""
    msgs: list[dict[str, Any]] = []
    if body.get("instructions"):
        msgs.append({"role": "system", "content": str(body["instructions"])})
    items = body.get("input")
    if isinstance(items, str):
        return [*msgs, {"role": "user", "content": items}]
    if not isinstance(items, list):
        raise bad_request("input: expected a string or a list of items", "input", "invalid_value")
    reasoning = None
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where}: expected an object", where, "invalid_value")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"{where}.role: {role!r} is not one of user, assistant, system, developer", f"{where}.role",
                                  "invalid_value")
            msg = {"role": role, "content": _text(item.get("content"), f"{where}.content")}
            if role == "assistant" and reasoning is not None:
                msg["reasoning_content"], reasoning = reasoning, None
            msgs.append(msg)
        elif kind == "function_call":
            call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}}
            last = msgs[-1] if msgs else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                if reasoning is not None:
                    last["reasoning_content"], reasoning = reasoning, None
                msgs.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            out = item.get("output")
            msgs.append({"role": "tool", "tool_call_id": item.get("call_id"),
                         "content": out if isinstance(out, str) else _text(out, f"{where}.output")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning = "".join(p.get("text", "") for p in parts if isinstance(p, dict))
        else:
            raise bad_request(f"{where}.type: {kind!r} items are not supported (message, function_call, "
                              "function_call_output, reasoning)", f"{where}.type", "unsupported_parameter")
    return msgs


def to_chat(body: dict[str, Any], history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completions request equivalent to a Responses request."""
    for key in body:
        if key not in KNOWN:
            raise ApiError(400, f"Unrecognized request argument supplied: {key}", key, "unknown_parameter")
    chat = {k: body[k] for k in PASSED if body.get(k) is not None}
    chat["messages"] = [*history, *to_messages(body)]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    tools = []
    for i, t in enumerate(body.get("tools") or []):
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else t
            raise bad_request(f"tools[{i}].type: only function tools are supported (got {kind!r})", f"tools[{i}].type",
                              "unsupported_parameter")
        tools.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict") if k in t}})
    if tools:
        chat["tools"] = tools
    choice = chat.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    effort = (body.get("reasoning") or {}).get("effort") if isinstance(body.get("reasoning"), dict) else None
    if effort is not None:
        chat["reasoning_effort"] = effort
    return chat


def _item(block: Block, done: bool) -> dict[str, Any]:
    status = "completed" if done else "in_progress"
    if block.kind == "reasoning":
        return {"type": "reasoning", "id": f"rs_{block.index}", "summary": [],
                "content": [{"type": "reasoning_text", "text": block.text}] if done else [], "status": status}
    if block.kind == "call":
        return {"type": "function_call", "id": f"fc_{block.call_id[5:]}", "call_id": block.call_id, "name": block.name,
                "arguments": block.text if done else "", "status": status}
    return {"type": "message", "id": f"msg_{block.index}", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": block.text, "annotations": [], "logprobs": []}] if done else []}


class Responses:
    def __init__(self, state: Any) -> None:
        self.state = state
        self.chat = Generate(state, chat=True)
        self.kept: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        self.lock = threading.Lock()

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        engine = self.state.require_ready()
        body = read_json(req, self.state.config.max_body_bytes)
        history: list[dict[str, Any]] = []
        prev = body.get("previous_response_id")
        if prev is not None:
            with self.lock:
                history = list(self.kept.get(prev) or [])
            if not history:
                raise ApiError(404, f"previous_response_id: no response {prev!r} is kept by this server (send the whole input)",
                               "previous_response_id", "previous_response_not_found")
        chat = for_model(parse_body(to_chat(body, history), chat=True), engine)
        choices, mux, prompt_tokens, _ = self.chat.submit(engine, chat, always_parse=True)
        c = choices[0]
        shell = {"id": "resp_" + uuid.uuid4().hex[:24], "object": "response", "created_at": int(time.time()),
                 "model": engine.model_name, "instructions": body.get("instructions"), "tools": body.get("tools") or [],
                 "tool_choice": body.get("tool_choice") or "auto", "parallel_tool_calls": body.get("parallel_tool_calls", True),
                 "temperature": body.get("temperature"), "top_p": body.get("top_p"), "metadata": body.get("metadata") or {},
                 "max_output_tokens": body.get("max_output_tokens"), "text": body.get("text") or {"format": {"type": "text"}},
                 "previous_response_id": prev, "error": None, "incomplete_details": None}
        blocks = Blocks()
        chat_history = [m.model_dump(exclude_none=True) for m in chat.messages]

        def final() -> dict[str, Any]:
            out = {**shell, "status": "completed", "output": [_item(b, True) for b in blocks.blocks],
                   "usage": {"input_tokens": prompt_tokens, "output_tokens": c.completion_tokens,
                             "total_tokens": prompt_tokens + c.completion_tokens,
                             "input_tokens_details": {"cached_tokens": c.cached_tokens},
                             "output_tokens_details": {"reasoning_tokens": 0}}}
            if c.finish_reason == "length":
                out["status"], out["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
            self.state.metrics.count_completion(c.completion_tokens)
            self._keep(out["id"], chat_history, blocks.blocks)
            return out

        if not chat.stream:
            for _ in drive(c, mux, blocks, keepalive=None):
                pass
            resp.media = final()
            return
        seq = iter(range(1 << 62))

        def event(kind: str, **data: Any) -> bytes:
            payload = {"type": kind, "sequence_number": next(seq), **data}
            return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()

        def steps(batch: list[Step]) -> Iterator[bytes]:
            for s in batch:
                b, ids = s.block, {"output_index": s.block.index}
                item_id = _item(b, False)["id"]
                if s.what == "open":
                    yield event("response.output_item.added", **ids, item=_item(b, False))
                    if b.kind == "text":
                        yield event("response.content_part.added", **ids, item_id=item_id, content_index=0,
                                    part={"type": "output_text", "text": "", "annotations": []})
                elif s.what == "delta":
                    if b.kind == "text":
                        yield event("response.output_text.delta", **ids, item_id=item_id, content_index=0, delta=s.text,
                                    logprobs=[])
                    elif b.kind == "reasoning":
                        yield event("response.reasoning_text.delta", **ids, item_id=item_id, content_index=0, delta=s.text)
                    else:
                        yield event("response.function_call_arguments.delta", **ids, item_id=item_id, delta=s.text)
                else:
                    if b.kind == "text":
                        yield event("response.output_text.done", **ids, item_id=item_id, content_index=0, text=b.text, logprobs=[])
                        yield event("response.content_part.done", **ids, item_id=item_id, content_index=0,
                                    part={"type": "output_text", "text": b.text, "annotations": []})
                    elif b.kind == "reasoning":
                        yield event("response.reasoning_text.done", **ids, item_id=item_id, content_index=0, text=b.text)
                    else:
                        yield event("response.function_call_arguments.done", **ids, item_id=item_id, name=b.name,
                                    arguments=b.text)
                    yield event("response.output_item.done", **ids, item=_item(b, True))

        def stream() -> Iterator[bytes]:
            start = {**shell, "status": "in_progress", "output": [], "usage": None}
            yield event("response.created", response=start)
            yield event("response.in_progress", response=start)
            try:
                for batch in drive(c, mux, blocks, keepalive=KEEPALIVE_S):
                    if batch is None:
                        yield b": keep-alive\n\n"
                        continue
                    yield from steps(batch)
            except ApiError as e:
                yield event("error", code=e.code, message=e.message, param=e.param)
                return
            done = final()
            yield event("response.completed" if done["status"] == "completed" else "response.incomplete", response=done)

        stream_sse(resp, stream())

    def _keep(self, rid: str, history: list[dict[str, Any]], blocks: list[Block]) -> None:
        answer: dict[str, Any] = {"role": "assistant", "content": "".join(b.text for b in blocks if b.kind == "text")}
        calls = [{"id": b.call_id, "type": "function", "function": {"name": b.name, "arguments": b.text}}
                 for b in blocks if b.kind == "call"]
        if calls:
            answer["tool_calls"] = calls
        reasoning = "".join(b.text for b in blocks if b.kind == "reasoning")
        if reasoning:
            answer["reasoning_content"] = reasoning
        with self.lock:
            self.kept[rid] = [*history, answer]
            while len(self.kept) > MAX_KEPT:
                self.kept.popitem(last=False)
