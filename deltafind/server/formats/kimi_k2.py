"""Kimi K2 tool calls: `<|tool_call_begin|>functions.NAME:N<|tool_call_argument_begin|>{...}`, in a calls section.

Chosen when the vocabulary has the section marker; the template renders tools
and results itself.
"""

from __future__ import annotations

import re
from typing import Any

from deltafind.server.formats.template import ChatFormat
from deltafind.server.structured import lark_json, lark_literal
from deltafind.server.tools import ToolSpec


class KimiK2(ChatFormat):
    name = "kimi_k2"
    call_open, call_close = "<|tool_call_begin|>", "<|tool_call_end|>"
    section_open, section_close = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    header = re.compile(
        r"<\|tool_call_begin\|>\s*(?:functions\.)?(?P<name>[^:<\s]+)(?::\d+)?\s*<\|tool_call_argument_begin\|>\s*(?=\{)"
    )

    def call_rule(self, tool: ToolSpec, lit: Any) -> str:
        return (
            f'{lit(self.call_open)} {lark_literal("functions." + tool.name)} ":" /[0-9]+/ '
            f'{lit("<|tool_call_argument_begin|>")} {lark_json(tool.parameters)} {lit(self.call_close)}'
        )


KIMI_K2 = KimiK2()
