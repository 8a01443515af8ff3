"""The template-only chat format, and the base every format refines: prompt, call grammar, parser hooks.

A format renders a conversation with its tools and results into prompt ids (once
per request), writes the Lark grammar of its calls and tells server/output.py's
parser where its reasoning, calls and arguments are. This one speaks no call
markup: the model's own chat template is the whole of it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from deltafind.server.errors import bad_request
from deltafind.server.structured import json_schema_grammar, lark_json, lark_literal
from deltafind.server.tools import ToolSpec

THINK = ("<think>", "</think>")


@dataclass
class Prompt:
    ids: list[int]
    in_think: bool = False  # the prompt ends inside an open think block
    history_end: int = (
        0  # prompt tokens up to the end of the history, when per-request messages follow it
    )


@dataclass
class Request:
    """What a format needs of one chat request, checked (server/chat_plan.py)."""

    messages: list[dict[str, Any]]
    tools: list[ToolSpec]
    mode: str  # tool_choice: auto | none | required
    thinking: bool
    reasoning_effort: str | None
    kwargs: dict[str, Any]  # chat_template_kwargs
    response_format: dict[str, Any] | None


class ChatFormat:
    """Template-only: no call markup (None below); subclasses name theirs and refine the hooks."""

    name = "template"
    call_open: str | None = None  # starts each call
    header: Any = None  # regex from call_open on (group `name`), ending where the arguments begin
    call_close = ""  # follows the arguments
    section_open: str | None = None  # wraps all calls (None: calls stand alone)
    section_close: str | None = None
    leads: tuple[
        str, ...
    ] = ()  # call openers that count only as the answer's first text (the call is the answer)
    strip: tuple[str, ...] = ()  # channel markers dropped from the answer
    call_sep = " "  # between parallel calls, in the grammar
    parallel = True  # the markup can hold several calls
    think_under_grammar = (
        False  # a grammar starts at the think channel (else thinking is off under one)
    )

    @property
    def start(self) -> str | None:
        """The text in an answer that begins its calls (None: never in running text)."""
        return None if self.leads else self.section_open or self.call_open

    @property
    def openers(self) -> tuple[str, ...]:
        return tuple(x for x in (self.call_open, *self.leads) if x)

    def detect(self, tokenizer: Any) -> bool:
        """Whether a tokenizer that declares no format speaks this one (its vocabulary, its template):
        here, a format that wraps its calls in a section marker where the vocabulary has that marker."""
        return self.section_open is None or tokenizer.token_to_id(self.section_open) is not None

    # -- the prompt --------------------------------------------------------------

    def native(self, tokenizer: Any) -> bool:
        """Whether the chat template renders `tools` itself."""
        return "tools" in tokenizer.chat_template_source

    def render(self, tokenizer: Any, req: Request) -> Prompt:
        native = self.native(tokenizer)
        msgs = self.history(_call_objects(req.messages), req.messages, native, req.tools)
        extra = {k: v for k, v in req.kwargs.items() if k not in ("enable_thinking", "thinking")}
        extra.update(enable_thinking=req.thinking, thinking=req.thinking)
        tpl_tools = [t.raw for t in req.tools] if native and req.tools else None
        text, ids = tokenizer.chat_prompt(msgs, tools=tpl_tools, **extra)
        tail = (
            text.rstrip()
        )  # HF templates put nothing per-request after the history: no history_end
        return Prompt(
            ids, self.think(tokenizer) is not None and tail.rfind(THINK[0]) > tail.rfind(THINK[1])
        )

    def history(
        self,
        msgs: list[dict[str, Any]],
        sent: list[dict[str, Any]],
        native: bool,
        tools: list[ToolSpec],
    ) -> list[dict[str, Any]]:
        """The messages as this template reads them (`sent`: as the client sent them)."""
        return msgs

    def think(self, tokenizer: Any) -> tuple[str, str] | None:
        return THINK if THINK[1] in tokenizer.chat_template_source else None

    # -- the grammar ---------------------------------------------------------------

    def call_grammar(
        self, tokenizer: Any, tools: list[ToolSpec], parallel: bool, prefix: str = ""
    ) -> str:
        """Lark: one call (or several, `parallel`) of `tools`, arguments valid against their schemas."""
        lit = literal(tokenizer)
        calls = f"call ({self.call_sep}call)*" if parallel and self.parallel else "call"
        if self.section_open:
            calls = f"{self.mark(self.section_open, lit)} {calls} {self.mark(self.section_close or '', lit)}"
        rules = [f"call_{i}: {self.call_rule(t, lit)}" for i, t in enumerate(tools)]
        return "\n".join(
            [
                f"start: {prefix} {calls}".replace("  ", " "),
                "call: " + " | ".join(f"call_{i}" for i in range(len(tools))),
                *rules,
            ]
        )

    def call_rule(self, tool: ToolSpec, lit: Any) -> str:
        """The Lark body of one call of `tool`; further lines, if any, are rules that body uses."""
        raise NotImplementedError

    def mark(self, text: str, lit: Any) -> str:
        return lit(text)

    def answer_prefix(self, tokenizer: Any, thinking: bool, calls: bool) -> str:
        """Lark before the answer a grammar enforces (a think channel, say); `calls`: before required calls."""
        return ""

    def schema_grammar(
        self, tokenizer: Any, thinking: bool, schema: dict[str, Any], field: str
    ) -> str:
        return json_schema_grammar(schema, field)

    # -- the parser (server/output.py) -----------------------------------------------

    def begin_args(self, buf: str, final: bool) -> tuple[str | None, str]:
        """(json | elements, or None to wait for more text; the buffer from the arguments on)."""
        return "json", buf

    def elements(self, text: str, tool: ToolSpec | None) -> dict[str, Any]:
        """The arguments of one call written as elements (`text`: up to its call_close)."""
        raise NotImplementedError

    @staticmethod
    def json_or_text(text: str) -> Any:
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text

    def whole_call(self, block: str) -> str:
        """The JSON object of a call read whole ({"arguments": ..., "name": ...} in another key order)."""
        return block.removeprefix(self.call_open or "").split(self.call_close)[0]


def literal(tokenizer: Any) -> Any:
    """A Lark literal maker: a marker that is one token is matched as that token (special or not)."""

    def lit(text: str) -> str:
        tid = tokenizer.token_to_id(text)
        return f"<[{tid}]>" if tid is not None and len(text) > 1 else lark_literal(text)

    return lit


def wrapped(params: dict[str, Any], name: str, args_key: str) -> str:
    """Lark for the `{"name": ..., "arguments": {...}}` object a JSON call writes, as one schema.

    `$ref`s point from the schema's root: its `$defs`/`definitions` (and lenient mark) move up to the new root.
    """
    hoist = ("$defs", "definitions", "x-guidance")
    inner = {k: v for k, v in params.items() if k not in hoist}
    return lark_json(
        {
            "type": "object",
            "properties": {"name": {"const": name}, args_key: inner},
            "required": ["name", args_key],
            "additionalProperties": False,
            **{k: params[k] for k in hoist if k in params},
        }
    )


def _call_objects(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with each call's `arguments` (a JSON string, as OpenAI sends them) as the object templates print."""
    out = []
    for i, m in enumerate(messages):
        if m.get("tool_calls"):
            m = {
                **m,
                "tool_calls": [
                    {
                        **c,
                        "function": {
                            **(c.get("function") or {}),
                            "arguments": arguments_object(
                                (c.get("function") or {}).get("arguments"),
                                f"messages[{i}].tool_calls[{j}].function.arguments",
                            ),
                        },
                    }
                    for j, c in enumerate(m["tool_calls"])
                ],
            }
        out.append(m)
    return out


def arguments_object(args: Any, where: str) -> dict[str, Any]:
    if isinstance(args, dict):
        return args
    if args is None or (isinstance(args, str) and not args.strip()):
        return {}
    try:
        value = json.loads(args)
    except (TypeError, json.JSONDecodeError):
        raise bad_request(
            f"{where}: arguments are not valid JSON", where, "invalid_value"
        ) from None
    if not isinstance(value, dict):
        raise bad_request(f"{where}: arguments must be a JSON object", where, "invalid_value")
    return value
