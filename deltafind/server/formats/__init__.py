"""Chat formats, one file each (template.py: the base); the registry below picks one per tokenizer.

A tokenizer that declares its format (`Tokenizer.chat_format`) gets that one;
any other gets the first below whose `detect` knows its vocabulary or template.
To add a format: one file with a `ChatFormat` subclass; import it here and place it in FORMATS.
"""

from typing import Any

from deltafind.errors import UnsupportedModelError
from deltafind.server.formats.deepseek_v3 import DEEPSEEK_V3
from deltafind.server.formats.hermes import HERMES
from deltafind.server.formats.kimi_k2 import KIMI_K2
from deltafind.server.formats.kimi_k3 import KIMI_K3
from deltafind.server.formats.llama3 import LLAMA3
from deltafind.server.formats.qwen3_coder import QWEN3_CODER
from deltafind.server.formats.template import ChatFormat, Prompt, Request

FORMATS: tuple[ChatFormat, ...] = (
    KIMI_K3,
    KIMI_K2,
    DEEPSEEK_V3,
    LLAMA3,
    QWEN3_CODER,
    HERMES,  # detects every template: the last
)


def pick_format(tokenizer: Any) -> ChatFormat:
    declared = tokenizer.chat_format
    for f in FORMATS:
        if (f.name == declared) if declared else f.detect(tokenizer):
            return f
    raise UnsupportedModelError(f"the tokenizer declares chat format {declared!r}, which is not one of "
                                f"{', '.join(f.name for f in FORMATS)}")


__all__ = ["DEEPSEEK_V3", "FORMATS", "HERMES", "KIMI_K2", "KIMI_K3", "LLAMA3", "ChatFormat", "Prompt", "Request", "pick_format"]
