"""Llama 3 JSON tool calls: the whole answer is `{"name": ..., "parameters": {...}}` (or after `<|python_tag|>`).

One call per answer, so no parallel calls; and since `{` is ordinary text, a
call is read only when it opens the answer, and `tool_choice: auto` is not
enforced by a grammar.
"""

from __future__ import annotations

import re
from typing import Any

from deltafind.server.formats.template import ChatFormat, wrapped
from deltafind.server.tools import ToolSpec

PYTHON_TAG = "<|python_tag|>"


class Llama3(ChatFormat):
    name = "llama3"
    call_open, call_close = "{", "}"
    header = re.compile(
        r'(?:<\|python_tag\|>)?\{\s*"name"\s*:\s*"(?P<name>[^"]+)"\s*,\s*"(?:parameters|arguments)"\s*:\s*(?=\{)'
    )
    leads = ("{", PYTHON_TAG)
    parallel = False

    def detect(self, tokenizer: Any) -> bool:
        source = tokenizer.chat_template_source
        return (
            "tools" in source
            and "<tool_call>" not in source
            and ("<|python_tag|>" in source or '"parameters"' in source)
        )

    def call_rule(self, tool: ToolSpec, lit: Any) -> str:
        return wrapped(tool.parameters, tool.name, "parameters")

    def whole_call(self, block: str) -> str:
        return block.removeprefix(PYTHON_TAG)


LLAMA3 = Llama3()
