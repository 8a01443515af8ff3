"""Chat formats, one file each (template.py: the base); the registry below picks one per tokenizer.

A tokenizer that declares its format (`Tokenizer.chat_format`) gets that one;
any other gets the first in FORMATS whose `detect` knows its vocabulary or template.
To add a format: one file with a `ChatFormat` subclass and its instance, plus its line in REGISTRY.
"""

import importlib
from typing import Any

from deltafind.errors import UnsupportedModelError
from deltafind.server.formats.template import ChatFormat, Prompt, Request

REGISTRY = (  # "module:instance", in the order detection tries them
    "kimi_k3:KIMI_K3",
    "kimi_k2:KIMI_K2",
    "deepseek_v3:DEEPSEEK_V3",
    "llama3:LLAMA3",
    "qwen3_coder:QWEN3_CODER",
    "hermes:HERMES",  # detects every template: the last
)
FORMATS: tuple[ChatFormat, ...] = tuple(
    getattr(importlib.import_module(f"{__name__}.{module}"), name)
    for module, name in (entry.split(":") for entry in REGISTRY)
)


def pick_format(tokenizer: Any) -> ChatFormat:
    declared = tokenizer.chat_format
    for f in FORMATS:
        if (f.name == declared) if declared else f.detect(tokenizer):
            return f
    raise UnsupportedModelError(
        f"the tokenizer declares chat format {declared!r}, which is not one of "
        f"{', '.join(f.name for f in FORMATS)}"
    )


__all__ = ["FORMATS", "REGISTRY", "ChatFormat", "Prompt", "Request", "pick_format"]
