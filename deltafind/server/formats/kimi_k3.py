"""Kimi K3's XTML (docs/kimi-k3-format.md §6.6): think and response channels, `call` elements in a `tools` section.

Declared by its tokenizer (tokenizer/kimi.py), which renders the XTML prompt;
this format hands it the tools, tool_choice, response format and thinking effort,
finds where the history ends, and writes and reads calls: typed `argument`
elements, or one `json` element where a schema has no typed form.
"""

from __future__ import annotations

import json
import re
from typing import Any

from deltafind.server.formats.template import ChatFormat, Prompt, Request
from deltafind.server.structured import lark_json, lark_literal
from deltafind.server.tools import ToolSpec
from deltafind.tokenizer.kimi_xtml import CLOSE, EOM, OPEN, SEP

JSON_OPEN, JSON_CLOSE = f'{OPEN}json type="object"{SEP}', f"{CLOSE}json{SEP}"
ARGUMENT = re.compile(
    r'<\|open\|>argument key="(?P<key>[^"]*)" type="(?P<type>\w+)"<\|sep\|>(?P<value>.*?)<\|close\|>argument<\|sep\|>',
    re.S,
)
# OpenAI reasoning_effort -> K3 thinking_effort (K3 takes low, high, max: `medium` rounds up to high).
EFFORT = {"low": "low", "medium": "high", "high": "high", "max": "max"}


class KimiK3(ChatFormat):
    name = "kimi_k3"
    call_open, call_close = f"{OPEN}call", f"{CLOSE}call{SEP}"
    section_open, section_close = f"{OPEN}tools{SEP}", f"{CLOSE}tools{SEP}"
    header = re.compile(r'<\|open\|>call tool="(?P<name>[^"]*)" index="\d+"<\|sep\|>')
    strip = (f"{OPEN}response{SEP}", f"{CLOSE}response{SEP}", f"{CLOSE}message{SEP}", EOM)
    think_under_grammar = True

    def detect(self, tokenizer: Any) -> bool:
        return False  # only by declaration

    def think(self, tokenizer: Any) -> tuple[str, str] | None:
        return f"{OPEN}think{SEP}", f"{CLOSE}think{SEP}"

    def render(self, tokenizer: Any, req: Request) -> Prompt:
        tc = {"required": "required", "none": "none"}.get(req.mode) if req.tools else None
        effort = EFFORT.get(req.reasoning_effort or "", req.kwargs.get("thinking_effort", "max"))
        # Rendered in two parts, each once: the history (tool declarations and effort first), then what only this
        # request adds (the tool-choice and response-format messages, the generation prompt). The next turn's prompt
        # repeats the history but not those messages, so the engine keeps a prefix-cache checkpoint where the history
        # ends (KDA state resumes only where it was stored).
        head = tokenizer.apply_chat_template(
            req.messages,
            add_generation_prompt=False,
            thinking=req.thinking,
            tools=[t.raw for t in req.tools] or None,
            thinking_effort=effort if req.thinking else None,
        )
        tail = tokenizer.apply_chat_template(
            [],
            tool_choice=tc,
            response_format=req.response_format,
            thinking=req.thinking,
            tools=None,
            thinking_effort=None,
        )
        per_request = tc or (req.response_format or {}).get("type") not in (None, "text")
        return Prompt(head + tail, req.thinking, len(head) if per_request else 0)

    # -- the grammar ---------------------------------------------------------------

    def mark(
        self, text: str, lit: Any
    ) -> str:  # XTML markers are single tokens, the rest plain text
        return " ".join(lit(p) for p in re.split(r"(<\|(?:open|close|sep)\|>)", text) if p)

    def call_rule(self, tool: ToolSpec, lit: Any) -> str:
        typed = self._arguments(tool.parameters, lambda text: self.mark(text, lit))
        args = (
            typed
            if typed is not None
            else f"{self.mark(JSON_OPEN, lit)} {lark_json(tool.parameters)} {self.mark(JSON_CLOSE, lit)}"
        )
        return (
            f'{self.mark(self.call_open, lit)} {lark_literal(" tool=" + chr(34) + tool.name + chr(34) + " index=")} "\\"" '
            f'/[1-9][0-9]*/ "\\"" {self.mark(SEP, lit)} {args} {self.mark(self.call_close, lit)}'
        )

    def _arguments(self, params: dict[str, Any], k3: Any) -> str | None:
        """Lark for typed `argument` elements of a flat schema, in its property order (None: not expressible,
        e.g. a string pattern or a union type; the call then takes the `json` element)."""
        required = set(params.get("required") or [])
        style = {
            k: params[k] for k in ("x-guidance",) if k in params
        }  # a lenient schema stays lenient in each argument
        parts = []
        for key, sub in (params.get("properties") or {}).items():
            if not isinstance(sub, dict) or re.search(r'[&"<>]', key) or "$ref" in json.dumps(sub):
                return None  # (a `$ref` points into the root's `$defs`, which only the `json` element keeps)
            kind = sub.get("type")
            if (
                "enum" in sub
                and all(isinstance(v, str) for v in sub["enum"])
                and kind in (None, "string")
            ):
                kind, value = "string", "(" + " | ".join(lark_literal(v) for v in sub["enum"]) + ")"
            elif kind == "string" and not any(
                k in sub for k in ("pattern", "format", "const", "enum")
            ):
                lo, hi = int(sub.get("minLength", 0)), sub.get("maxLength")
                value = f"/(?s:.{{{lo},{'' if hi is None else int(hi)}}})/"
            elif kind in ("integer", "number", "boolean", "object", "array", "null"):
                kind, value = {"integer": "number"}.get(kind, kind), lark_json({**sub, **style})
            else:
                return None
            elem = (
                f'{k3(OPEN + "argument")} {lark_literal(f" key={chr(34)}{key}{chr(34)} type={chr(34)}{kind}{chr(34)}")} '
                f'{k3(SEP)} {value} {k3(f"{CLOSE}argument{SEP}")}'
            )
            parts.append(f"({elem})" + ("" if key in required else "?"))
        return " ".join(parts) if parts else '""'

    def answer_prefix(self, tokenizer: Any, thinking: bool, calls: bool) -> str:
        # K3 answers after its think channel (free text; special tokens end it) in its response channel.
        o, c, sep = (f"<[{tokenizer.token_to_id(m)}]>" for m in (OPEN, CLOSE, SEP))
        answer = f'/(?s:.*)/ {c} "think" {sep} {o} "response" {sep}' if thinking else ""
        return f'{answer} /(?s:.*)/ {c} "response" {sep}' if calls else answer

    def schema_grammar(
        self, tokenizer: Any, thinking: bool, schema: dict[str, Any], field: str
    ) -> str:
        return f"start: {self.answer_prefix(tokenizer, thinking, False)} {lark_json(schema)}"

    # -- the parser ------------------------------------------------------------------

    def begin_args(self, buf: str, final: bool) -> tuple[str | None, str]:
        if buf.startswith(JSON_OPEN):
            return "json", buf[len(JSON_OPEN) :]
        return (None if JSON_OPEN.startswith(buf) and not final else "elements"), buf

    def elements(self, text: str, tool: ToolSpec | None) -> dict[str, Any]:
        return {
            m["key"]: m["value"] if m["type"] == "string" else self.json_or_text(m["value"])
            for m in ARGUMENT.finditer(text)
        }


KIMI_K3 = KimiK3()
