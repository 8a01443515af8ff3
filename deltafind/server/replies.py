"""OpenAI chat shapes around the output parser: request messages in, messages and stream deltas out.

Owns how a request's messages become the dicts chat templates read, how a
parsed choice becomes `message` (content, `reasoning_content`/`reasoning`,
`tool_calls`) and how parser `Delta`s become `delta` objects of stream chunks.
"""

from __future__ import annotations

from typing import Any

from deltafind.engine.constraint import ConstraintFactory
from deltafind.server.output import Delta
from deltafind.server.structured import Grammar, json_schema_grammar, response_format_schema


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
