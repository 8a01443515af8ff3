"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API run on the chat path.

Owns the answer's wire format: content blocks (text, thinking, tool_use), stop_reason
and stop_sequence, usage, and the SSE events the anthropic SDK parses (with `ping`
while a prompt prefills or waits). The request side is messages_request.py; the
error shape is errors.py's (by path).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import falcon
from pydantic_core import from_json

from deltafind.server.chat_plan import plan_chat
from deltafind.server.items import Block, Blocks, drive
from deltafind.server.lifecycle import AppState, RequestRun, stream_sse
from deltafind.server.messages_request import to_chat
from deltafind.server.openai import chat_messages
from deltafind.server.schemas import parse_body

STOP = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens"}


def _content(block: Block) -> dict[str, Any]:
    if block.kind == "reasoning":
        return {"type": "thinking", "thinking": block.text, "signature": ""}
    # a call cut by max_tokens keeps what parsed of its arguments (stop_reason says so)
    if block.kind == "call":
        try:
            args = from_json(block.text, allow_partial=True) if block.text else {}
        # not JSON at all (an unenforced Llama 3 call): no arguments rather than a 500
        except ValueError:
            args = {}
        return {
            "type": "tool_use",
            "id": block.call_id.replace("call_", "toolu_"),
            "name": block.name,
            "input": args if isinstance(args, dict) else {},
        }
    return {"type": "text", "text": block.text}


class Messages:
    def __init__(self, state: AppState) -> None:
        self.state = state

    def on_post_count_tokens(self, req: falcon.Request, resp: falcon.Response) -> None:
        """`{"input_tokens": N}`: the prompt /v1/messages would prefill for this request (tools and system included)."""
        run = RequestRun(
            self.state, req, lambda raw: parse_body(to_chat(raw, count_only=True), chat=True)
        )
        resp.media = {
            "input_tokens": len(
                plan_chat(run.engine.tokenizer, run.body, chat_messages(run.body), True).prompt_ids
            )
        }

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        run = RequestRun(self.state, req, lambda raw: parse_body(to_chat(raw), chat=True))
        engine, chat = run.engine, run.body
        c = run.submit(plan_chat(engine.tokenizer, chat, chat_messages(chat), True), clamp=True)[0]
        blocks = Blocks()
        shell = {
            "id": "msg_" + uuid.uuid4().hex[:24],
            "type": "message",
            "role": "assistant",
            "model": engine.model_name,
        }

        def usage() -> dict[str, Any]:
            return {
                "input_tokens": run.prompt_tokens - c.cached_tokens,
                "output_tokens": c.completion_tokens,
                "cache_read_input_tokens": c.cached_tokens,
                "cache_creation_input_tokens": 0,
            }

        def stop() -> dict[str, Any]:
            hit = (
                c.matcher.hit
            )  # the stop sequence that ended the answer (it is not part of the text)
            return {
                "stop_reason": "stop_sequence"
                if hit
                else STOP.get(c.finish_reason or "stop", "end_turn"),
                "stop_sequence": hit,
            }

        if not chat.stream:
            for _ in drive(run, blocks, stream=False):
                pass
            resp.media = {
                **shell,
                "content": [_content(b) for b in blocks.blocks],
                **stop(),
                "usage": usage(),
            }
            return

        def event(kind: str, **data: Any) -> bytes:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n".encode()

        def stream() -> Iterator[bytes]:
            yield event(
                "message_start",
                message={
                    **shell,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {"input_tokens": run.prompt_tokens, "output_tokens": 0},
                },
            )
            # Then a ping every KEEPALIVE_S while the prompt waits or prefills: clients time out a silent stream.
            for batch in drive(run, blocks, stream=True):
                if batch is None:
                    yield event("ping")
                    continue
                for s in batch:
                    b = s.block
                    if s.what == "open":
                        start = _content(
                            Block(b.kind, b.index, b.call_id, b.name)
                        )  # the block as it opens: empty
                        yield event("content_block_start", index=b.index, content_block=start)
                    elif s.what == "delta":
                        delta = (
                            {"type": "text_delta", "text": s.text}
                            if b.kind == "text"
                            else {"type": "thinking_delta", "thinking": s.text}
                            if b.kind == "reasoning"
                            else {"type": "input_json_delta", "partial_json": s.text}
                        )
                        yield event("content_block_delta", index=b.index, delta=delta)
                    else:
                        yield event("content_block_stop", index=b.index)
            yield event("message_delta", delta=stop(), usage=usage())
            yield event("message_stop")

        stream_sse(
            resp,
            stream(),
            lambda e: f"event: error\ndata: {json.dumps(e.anthropic_body())}\n\n".encode(),
        )
