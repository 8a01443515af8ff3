"""Hermes/Qwen tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the default.

Every template that names no other format gets it; one without tool support gets
its tool prompt in the system message and calls and results written as the text
a Hermes model reads.
"""

from __future__ import annotations

import json
import re
from typing import Any

from deltafind.server.formats.template import ChatFormat, wrapped
from deltafind.server.tools import ToolSpec

SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


class Hermes(ChatFormat):
    name = "hermes"
    call_open, call_close = "<tool_call>", "</tool_call>"
    header = re.compile(
        r'<tool_call>\s*\{\s*"name"\s*:\s*"(?P<name>[^"]+)"\s*,\s*"arguments"\s*:\s*(?=\{)'
    )
    call_sep = ' "\\n" '

    def native(self, tokenizer: Any) -> bool:
        return super().native(tokenizer) and "<tool_call>" in tokenizer.chat_template_source

    def call_rule(self, tool: ToolSpec, lit: Any) -> str:
        return f'{lit("<tool_call>")} "\\n" {wrapped(tool.parameters, tool.name, "arguments")} "\\n" {lit("</tool_call>")}'

    def history(
        self,
        msgs: list[dict[str, Any]],
        sent: list[dict[str, Any]],
        native: bool,
        tools: list[ToolSpec],
    ) -> list[dict[str, Any]]:
        """For a template without tools: calls become the text the model wrote, results a user turn."""
        if native:
            return msgs
        out: list[dict[str, Any]] = []
        for m, orig in zip(msgs, sent, strict=True):
            m = dict(m)
            # the arguments as the client sent them back (our own output, verbatim) so the tokens repeat
            if m.get("tool_calls"):
                raw = [
                    (
                        c["function"].get("name"),
                        (orig.get("tool_calls") or [])[j].get("function", {}).get("arguments"),
                    )
                    for j, c in enumerate(m.pop("tool_calls"))
                ]
                text = "".join(
                    f'\n<tool_call>\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '
                    f'{args if isinstance(args, str) and args.strip() else json.dumps(args or {}, ensure_ascii=False)}}}'
                    "\n</tool_call>"
                    for name, args in raw
                )
                m["content"] = (
                    ((m.get("content") or "") + text).lstrip("\n")
                    if m.get("content")
                    else text.lstrip("\n")
                )
            if m.get("role") == "tool":
                body = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
                if (
                    out
                    and out[-1].get("role") == "user"
                    and str(out[-1].get("content", "")).endswith("</tool_response>")
                ):
                    out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + body}
                else:
                    out.append({"role": "user", "content": body})
                continue
            out.append(m)
        if tools:
            prompt = SYSTEM.format(
                tools="\n".join(json.dumps(t.raw, ensure_ascii=False) for t in tools)
            )
            if out and out[0].get("role") == "system":
                out[0] = {
                    **out[0],
                    "content": f"{out[0].get('content') or ''}\n\n{prompt}".lstrip(),
                }
            else:
                out.insert(0, {"role": "system", "content": prompt})
        return out


HERMES = Hermes()
