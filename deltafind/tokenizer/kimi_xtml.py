"""Kimi K3's XTML chat prompt (docs/kimi-k3-format.md §6.6) as a list of segments, rendered as deltafin does.

A segment is control (special tokens read) or ordinary (plain BPE); each is
tokenized on its own, so BPE never merges across a boundary. Owns message
bodies, tool declarations and calls, tool-result ordering, response formats and
the generation prompt. Knows nothing of ids: kimi.py encodes the segments.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from deltafind.errors import RequestError

OPEN, CLOSE, SEP, EOM = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
EFFORTS = ("low", "high", "max")
BODY_TOOLS_STATIC = (
    "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n{tools}\n```"
)
BODY_TOOLS_DYNAMIC = (
    "## New Tools Available\nThe system dynamically extends the toolset via lazy-loading.\n"
    "You have access to all existing and extended tools.\nHere are the specs for the extended tools.\n\n```json\n{tools}\n```"
)
BODY_EFFORT = (
    "`thinking_effort` guides on how much to think in your thinking channel (not including the response channel), "
    "supported values include `low`, `medium`, `high`, and `max`.\nNow the system is invoked with `thinking_effort={effort}`."
)
BODY_TOOL_REQUIRED = (
    "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message."
)
BODY_TOOL_NONE = "The system is invoked with `tool_choice=none`.\nYou MUST NOT call any tools in the next message."
_RAW_JSON = "Your response must be raw JSON data without markdown code blocks (```json) or any additional formatting."
BODY_JSON_OBJECT = "The system is invoked with `response_format=json_object`.\n" + _RAW_JSON
BODY_JSON_SCHEMA = (
    "The system is invoked with `response_format=json_schema`.\n"
    + _RAW_JSON
    + "\nThe JSON data must match the following schema:\n```json\n{schema}\n```"
)


@dataclass(frozen=True)
class Segment:
    text: str
    control: bool = False


def compact_json(value: Any, ensure_ascii: bool = False) -> str:
    """Tool declarations and schemas: no spaces, keys sorted at every depth."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=ensure_ascii, sort_keys=True)


def spaced_json(value: Any, ensure_ascii: bool = False) -> str:
    return json.dumps(value, separators=(", ", ": "), ensure_ascii=ensure_ascii)


def _attr(value: Any) -> str:
    text = (
        value if isinstance(value, str) else str(value)
    )  # non-strings render Python-style (None/True/False)
    return text.replace("&", "&amp;").replace('"', "&quot;")


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


class XTMLRenderer:
    """Builds one prompt's segments; `json_ensure_ascii` is the UNKNOWN of docs/kimi-k3-format.md §6.6 (default: as deltafin)."""

    def __init__(self, json_ensure_ascii: bool = False) -> None:
        self.ascii = json_ensure_ascii
        self.out: list[Segment] = []

    def text(self, s: str, control: bool = False) -> None:
        if s:  # empty segments are dropped
            self.out.append(Segment(s, control))

    def open(self, tag: str, **attrs: Any) -> None:
        self.text(OPEN, True)
        self.text(tag)
        for key, value in attrs.items():
            for piece in (" " + key, '="', _attr(value), '"'):
                self.text(piece)
        self.text(SEP, True)

    def close(self, tag: str) -> None:
        self.text(CLOSE, True)
        self.text(tag)
        self.text(SEP, True)

    def system(self, kind: str, body: str) -> None:
        self.open("message", role="system", type=kind)
        self.text(body.strip())
        self.close("message")
        self.text(EOM, True)

    def content(self, content: Any) -> None:
        if content is None or isinstance(content, str):
            self.text(content or "")
            return
        for part in content:
            if isinstance(part, dict) and part.get("type") in ("image", "image_url"):
                raise RequestError(
                    "Kimi K3 image inputs are not supported by deltafind (text only)", "messages"
                )
            self.text((part.get("text") or "") if isinstance(part, dict) else str(part))

    def tool_calls(self, calls: list[dict[str, Any]]) -> None:
        self.open("tools")
        for i, call in enumerate(calls, 1):
            fn = call.get("function") or call
            self.open("call", tool=fn.get("name"), index=i)
            args = fn.get("arguments")
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError:
                    self.open("json", type="object")
                    self.text(fn["arguments"])
                    self.close("json")
                    self.close("call")
                    continue
            args = {} if args is None else args
            if not isinstance(args, dict):
                raise RequestError(
                    f"tool call {i} arguments are JSON but not an object", "messages"
                )
            for key, value in args.items():
                self.open("argument", key=key, type=_json_type(value))
                self.text(value if isinstance(value, str) else spaced_json(value, self.ascii))
                self.close("argument")
            self.close("call")
        self.close("tools")


def _normalize_tool_results(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Reorder each run of tool results to its assistant's call order, naming them from the calls."""
    out, i = [], 0
    while i < len(messages):
        out.append(messages[i])
        calls = messages[i].get("tool_calls") if messages[i].get("role") == "assistant" else None
        i += 1
        j = i
        while j < len(messages) and messages[j].get("role") == "tool":
            j += 1
        run = messages[i:j]
        if calls and run:
            order = {c.get("id"): n for n, c in enumerate(calls)}
            keys = [m.get("tool_call_id", m.get("id")) for m in run]
            if all(k in order for k in keys):
                run = [
                    {**m, "tool": (calls[order[k]].get("function") or calls[order[k]]).get("name")}
                    for k, m in sorted(zip(keys, run, strict=True), key=lambda km: order[km[0]])
                ]
        out.extend(run)
        i = j
    return out


def render_segments(
    messages: list[dict[str, Any]],
    tools: list[Any] | None = None,
    tool_choice: Any = None,
    response_format: dict[str, Any] | None = None,
    add_generation_prompt: bool = True,
    thinking: bool = True,
    thinking_effort: str | None = "max",
    json_ensure_ascii: bool = False,
) -> list[Segment]:
    """The XTML segments of a conversation, in deltafin's render order."""
    if thinking_effort is not None and thinking_effort not in EFFORTS:
        raise RequestError(
            f"thinking_effort must be one of {', '.join(EFFORTS)} (got {thinking_effort!r})",
            "thinking_effort",
        )
    r = XTMLRenderer(json_ensure_ascii)
    if tools:
        r.system(
            "tool-declare",
            BODY_TOOLS_STATIC.format(tools=compact_json(tools, r.ascii)),
        )
    if thinking and thinking_effort:
        r.system("thinking-effort", BODY_EFFORT.format(effort=thinking_effort))
    last_calls: list[dict[str, Any]] = []
    tool_index = 0
    for m in _normalize_tool_results(list(messages)):
        role, name = m.get("role"), ({"name": m["name"]} if m.get("name") else {})
        if role == "system" and m.get("tools"):
            r.system(
                "tool-declare",
                BODY_TOOLS_DYNAMIC.format(tools=compact_json(m["tools"], r.ascii)),
            )
            continue
        if role in ("user", "system"):
            r.open("message", role=role, **name)
            r.content(m.get("content"))
        elif role == "tool":
            tool_index += 1
            tool = m.get("tool") or m.get("name")
            if not tool and tool_index <= len(last_calls):
                tool = (
                    last_calls[tool_index - 1].get("function") or last_calls[tool_index - 1]
                ).get("name")
            r.open("message", role="tool", tool=tool, index=tool_index)
            r.content(m.get("content"))
        elif role == "assistant":
            r.open("message", role="assistant", **name)
            if thinking:
                r.open("think")
                reasoning = m.get("reasoning_content") or m.get("reasoning") or ""
                r.text(reasoning if reasoning.strip() else "")
                r.close("think")
            r.open("response")
            r.content(m.get("content"))
            r.close("response")
            last_calls, tool_index = list(m.get("tool_calls") or []), 0
            if last_calls:
                r.tool_calls(last_calls)
        else:
            raise RequestError(
                f"message role {role!r} is not one of system, user, assistant, tool", "messages"
            )
        r.close("message")
        r.text(EOM, True)
    if tool_choice == "required":
        r.system("tool-choice", BODY_TOOL_REQUIRED)
    elif tool_choice == "none":
        r.system("tool-choice", BODY_TOOL_NONE)
    kind = (response_format or {}).get("type")
    if kind == "json_object":
        r.system("response-format", BODY_JSON_OBJECT)
    elif kind == "json_schema":
        js = response_format.get("json_schema")  # type: ignore[union-attr]
        schema = js.get("schema", js.get("json_schema", js)) if isinstance(js, dict) else js
        r.system(
            "response-format",
            BODY_JSON_SCHEMA.format(schema=compact_json(schema, r.ascii)),
        )
    if add_generation_prompt:
        r.open("message", role="assistant")
        r.open("think" if thinking else "response")
    return r.out
