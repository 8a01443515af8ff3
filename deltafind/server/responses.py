"""POST /v1/responses (and /input_tokens): OpenAI's Responses API mapped onto the chat path.

Owns the answer's wire format: output items (reasoning with its `encrypted_content`, message,
function_call with its namespace) and the streaming events the openai SDK and Codex parse.
The request side (fields, tools, `input` items) is responses_input.py. `previous_response_id`
continues a conversation this process answered (kept in memory, newest 256).
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

from deltafind.server.chat_plan import plan_chat
from deltafind.server.errors import ApiError, bad_request
from deltafind.server.items import Block, Blocks, Step, drive
from deltafind.server.lifecycle import AppState, RequestRun, stream_sse
from deltafind.server.openai import chat_messages
from deltafind.server.responses_input import namespaced, seal_reasoning, to_chat
from deltafind.server.schemas import ChatRequest, parse_body

MAX_KEPT = 256
# Each block kind's streamed events: PREFIX.delta while it grows, PREFIX.done when it closes.
STREAMS = {
    "text": "response.output_text",
    "reasoning": "response.reasoning_text",
    "call": "response.function_call_arguments",
}


def _item(
    block: Block, done: bool, seal: bool = False, spaces: dict[str, tuple[str, str]] | None = None
) -> dict[str, Any]:
    status = "completed" if done else "in_progress"
    if block.kind == "reasoning":
        item = {
            "type": "reasoning",
            "id": f"rs_{block.index}",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": block.text}] if done else [],
            "status": status,
        }
        # include: ["reasoning.encrypted_content"] (a store: false client replays it)
        if seal and done:
            item["encrypted_content"] = seal_reasoning(block.text)
        return item
    if block.kind == "call":
        item = {
            "type": "function_call",
            "id": f"fc_{block.call_id[5:]}",
            "call_id": block.call_id,
            "name": block.name,
            "arguments": block.text if done else "",
            "status": status,
        }
        # a namespace's function: its call names both, as the reference API's
        if spaces and block.name in spaces:
            item["namespace"], item["name"] = spaces[block.name]
        return item
    return {
        "type": "message",
        "id": f"msg_{block.index}",
        "role": "assistant",
        "status": status,
        "content": [{"type": "output_text", "text": block.text, "annotations": [], "logprobs": []}]
        if done
        else [],
    }


class Responses:
    def __init__(self, state: AppState) -> None:
        self.state = state
        self.kept: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        self.lock = threading.Lock()

    def _request(self, body: dict[str, Any]) -> ChatRequest:
        history: list[dict[str, Any]] = []
        prev = body.get("previous_response_id")
        if prev is not None:
            if not isinstance(prev, str):
                raise bad_request(
                    "previous_response_id: expected a string (a response id)",
                    "previous_response_id",
                    "invalid_value",
                )
            with self.lock:
                history = list(self.kept.get(prev) or [])
            if not history:
                raise ApiError(
                    404,
                    f"previous_response_id: no response {prev!r} is kept by this server (send the whole input)",
                    "previous_response_id",
                    "previous_response_not_found",
                )
        return parse_body(to_chat(body, history), chat=True)  # type: ignore[return-value]  # chat=True gives a ChatRequest

    def on_post_input_tokens(self, req: falcon.Request, resp: falcon.Response) -> None:
        """POST /v1/responses/input_tokens: the prompt's length, as a request with this body would see it."""
        # The reference endpoint takes the create body; these keys say nothing about the input.
        ignored = ("stream", "max_output_tokens", "store", "include", "stream_options")
        run = RequestRun(
            self.state,
            req,
            lambda raw: self._request({k: v for k, v in raw.items() if k not in ignored}),
        )
        plan = plan_chat(run.engine.tokenizer, run.body, chat_messages(run.body), True)
        resp.media = {"object": "response.input_tokens", "input_tokens": len(plan.prompt_ids)}

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        run = RequestRun(self.state, req, self._request)
        engine, chat, body = run.engine, run.body, run.raw
        seal = (
            isinstance(body.get("include"), list)
            and "reasoning.encrypted_content" in body["include"]
        )
        spaces = namespaced(body.get("tools"))
        c = run.submit(plan_chat(engine.tokenizer, chat, chat_messages(chat), True))[0]
        shell = {
            "id": "resp_" + uuid.uuid4().hex[:24],
            "object": "response",
            "created_at": int(time.time()),
            "model": engine.model_name,
            "instructions": body.get("instructions"),
            "tools": body.get("tools") or [],
            "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": body.get("temperature"),
            "top_p": body.get("top_p"),
            "metadata": body.get("metadata") or {},
            "max_output_tokens": body.get("max_output_tokens"),
            "text": body.get("text") or {"format": {"type": "text"}},
            "previous_response_id": body.get("previous_response_id"),
            "error": None,
            "incomplete_details": None,
        }
        blocks = Blocks()
        chat_history = [m.model_dump(exclude_none=True) for m in chat.messages]

        def final() -> dict[str, Any]:
            out = {
                **shell,
                "status": "completed",
                "output": [_item(b, True, seal, spaces) for b in blocks.blocks],
                "usage": {
                    "input_tokens": run.prompt_tokens,
                    "output_tokens": c.completion_tokens,
                    "total_tokens": run.prompt_tokens + c.completion_tokens,
                    "input_tokens_details": {"cached_tokens": c.cached_tokens},
                    "output_tokens_details": {"reasoning_tokens": c.reasoning_tokens},
                },
            }
            if c.finish_reason == "length":
                out["status"], out["incomplete_details"] = (
                    "incomplete",
                    {"reason": "max_output_tokens"},
                )
            self._keep(out["id"], chat_history, blocks.blocks)
            return out

        if not chat.stream:
            for _ in drive(run, blocks, stream=False):
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
                at = {**ids, "item_id": _item(b, False)["id"]}
                # a call's arguments have no content part; text carries (empty) logprobs
                where = at if b.kind == "call" else {**at, "content_index": 0}
                lp: dict[str, Any] = {"logprobs": []} if b.kind == "text" else {}
                if s.what == "open":
                    yield event(
                        "response.output_item.added", **ids, item=_item(b, False, seal, spaces)
                    )
                    if b.kind == "text":
                        part = {"type": "output_text", "text": "", "annotations": []}
                        yield event("response.content_part.added", **where, part=part)
                elif s.what == "delta":
                    yield event(f"{STREAMS[b.kind]}.delta", **where, delta=s.text, **lp)
                else:
                    end = (
                        {"name": b.name, "arguments": b.text}
                        if b.kind == "call"
                        else {"text": b.text}
                    )
                    yield event(f"{STREAMS[b.kind]}.done", **where, **end, **lp)
                    if b.kind == "text":
                        part = {"type": "output_text", "text": b.text, "annotations": []}
                        yield event("response.content_part.done", **where, part=part)
                    yield event(
                        "response.output_item.done", **ids, item=_item(b, True, seal, spaces)
                    )

        def stream() -> Iterator[bytes]:
            start = {**shell, "status": "in_progress", "output": [], "usage": None}
            yield event("response.created", response=start)
            yield event("response.in_progress", response=start)
            for batch in drive(run, blocks, stream=True):
                if batch is None:
                    yield b": keep-alive\n\n"
                    continue
                yield from steps(batch)
            done = final()
            yield event(
                "response.completed" if done["status"] == "completed" else "response.incomplete",
                response=done,
            )

        stream_sse(
            resp, stream(), lambda e: event("error", code=e.code, message=e.message, param=e.param)
        )

    def _keep(self, rid: str, history: list[dict[str, Any]], blocks: list[Block]) -> None:
        answer = {
            "role": "assistant",
            "content": "".join(b.text for b in blocks if b.kind == "text"),
            "tool_calls": [
                {
                    "id": b.call_id,
                    "type": "function",
                    "function": {"name": b.name, "arguments": b.text},
                }
                for b in blocks
                if b.kind == "call"
            ],
            "reasoning_content": "".join(b.text for b in blocks if b.kind == "reasoning"),
        }
        # the answer as a chat message: content always, calls and reasoning when there are any
        kept = {k: v for k, v in answer.items() if v or k == "content"}
        with self.lock:
            self.kept[rid] = [*history, kept]
            while len(self.kept) > MAX_KEPT:
                self.kept.popitem(last=False)
