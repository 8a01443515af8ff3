"""What every settings section shares: the frozen base model, the "live" marker and its test."""

from __future__ import annotations

import re
import sys
from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic.fields import FieldInfo

LIVE: dict[str, Any] = {"live": True}
DEVICE_RE = re.compile(r"auto|cpu|cuda|cuda:\d+|mps")
# sun_path holds 108 bytes on Linux and 104 on macOS, NUL included.
MAX_SOCKET_PATH = 103 if sys.platform == "darwin" else 107


def is_live(field: FieldInfo) -> bool:
    """Whether `deltafinctl reload` applies this field without a restart."""
    extra = field.json_schema_extra
    return isinstance(extra, dict) and extra.get("live") is True


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
