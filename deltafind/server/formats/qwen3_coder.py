"""Qwen3-Coder's XML tool calls: `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nvalue\\n</parameter>\\n...</function>`.

Chosen when the chat template writes `<function=`; the template renders tools
and results itself. A string value is raw text (it ends at the first
`\\n</parameter>`); any other value is JSON, read back by the tool's schema.
"""

from __future__ import annotations

import re
from typing import Any

from deltafind.server.formats.template import ChatFormat
from deltafind.server.structured import lark_json, lark_literal
from deltafind.server.tools import ToolSpec

PARAMETER = re.compile(r"<parameter=(?P<key>[^>\n]+)>\n?(?P<value>.*?)\n?</parameter>", re.S)


class Qwen3Coder(ChatFormat):
    name = "qwen3_coder"
    call_open, call_close = "<tool_call>", "</tool_call>"
    header = re.compile(r"<tool_call>\s*<function=(?P<name>[^>\n]+)>\n?")
    call_sep = ' "\\n" '

    def detect(self, tokenizer: Any) -> bool:
        return "<function=" in tokenizer.chat_template_source

    def call_rule(self, tool: ToolSpec, lit: Any) -> str:
        params, rules, parts = tool.parameters, [], []
        shared = {
            k: params[k] for k in ("$defs", "definitions", "x-guidance") if k in params
        }  # what a `$ref` points into
        for n, (key, sub) in enumerate((params.get("properties") or {}).items()):
            sub = sub if isinstance(sub, dict) else {}
            if (
                "enum" in sub
                and all(isinstance(v, str) for v in sub["enum"])
                and sub.get("type") in (None, "string")
            ):
                value = (
                    "(" + " | ".join(lark_literal(v) for v in sub["enum"]) + ') "\\n</parameter>"'
                )
            elif sub.get("type") == "string" and not any(
                k in sub for k in ("pattern", "format", "const")
            ):
                lo, hi = int(sub.get("minLength", 0)), sub.get("maxLength")
                value = (
                    f"text_{tool.index}_{n}"  # lazy: the value ends at the first `\n</parameter>`
                )
                rules.append(
                    f'{value}[suffix="\\n</parameter>"]: /(?s:.{{{lo},{"" if hi is None else int(hi)}}})/'
                )
            else:
                value = f'{lark_json({**sub, **shared})} "\\n</parameter>"'
            elem = f'"<parameter=" {lark_literal(key)} ">\\n" {value} "\\n"'
            parts.append(f"({elem})" + ("" if key in set(params.get("required") or []) else "?"))
        body = f'{lit(self.call_open)} "\\n<function=" {lark_literal(tool.name)} ">\\n" {" ".join(parts)} "</function>\\n" {lit(self.call_close)}'
        return "\n".join([body, *rules])

    def begin_args(self, buf: str, final: bool) -> tuple[str | None, str]:
        return "elements", buf

    def elements(self, text: str, tool: ToolSpec | None) -> dict[str, Any]:
        props = (tool.parameters.get("properties") or {}) if tool else {}
        # a string parameter stays as written, anything else is read as JSON
        return {
            m["key"]: m["value"]
            if _is_string(props.get(m["key"]))
            else self.json_or_text(m["value"])
            for m in PARAMETER.finditer(text)
        }


def _is_string(schema: Any) -> bool:
    return isinstance(schema, dict) and (
        schema.get("type") == "string" or (schema.get("type") is None and "enum" in schema)
    )


QWEN3_CODER = Qwen3Coder()
