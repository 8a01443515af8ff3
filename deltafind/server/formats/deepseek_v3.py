"""DeepSeek-V3 tool calls: a call-begin marker, `function`, a separator, the name and a ```json block, in a calls section.

Chosen when the vocabulary has the section marker; the template renders tools
and results itself.
"""

from __future__ import annotations

import re
from typing import Any

from deltafind.server.formats.template import ChatFormat
from deltafind.server.structured import lark_json, lark_literal
from deltafind.server.tools import ToolSpec


class DeepSeekV3(ChatFormat):
    name = "deepseek_v3"
    call_open, call_close = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
    section_open, section_close = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    header = re.compile(
        r"<｜tool▁call▁begin｜>(?:function<｜tool▁sep｜>)?(?P<name>[^\n<｜]+?)(?:\n```json\n|<｜tool▁sep｜>)(?=\{)"
    )

    def call_rule(self, tool: ToolSpec, lit: Any) -> str:
        return (
            f'{lit(self.call_open)} "function" {lit("<｜tool▁sep｜>")} {lark_literal(tool.name)} "\\n```json\\n" '
            f'{lark_json(tool.parameters)} "\\n```" {lit(self.call_close)}'
        )


DEEPSEEK_V3 = DeepSeekV3()
