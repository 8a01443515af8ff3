"""Render the documented example config (etc/deltafind.toml) from the schema.

Nothing here is written by hand per key: descriptions, defaults, examples and
the live/restart marks all come from the fields, so the file cannot drift.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import PurePath
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from deltafind.config.schema import DriveSettings, Settings, is_live
from deltafind.config.types import ByteSize, FileMode

REGENERATE = "python -m deltafind.config > etc/deltafind.toml"

_HEADER = f"""\
# deltafind configuration: every key, its default and what it does.
# GENERATED from deltafind/config/schema.py by `{REGENERATE}`
# (`make etc`); edit the schema, not this file.
#
# The daemon reads /etc/deltafind/deltafind.toml (or the file given with
# --config). Values shown are the defaults; keys commented out are unset.
# Precedence: command-line flags > DELTAFIND_* environment variables > this
# file > defaults. A variable names a key as DELTAFIND_<SECTION>__<KEY>, e.g.
# DELTAFIND_CACHE__EXPERT_BYTES=8GiB; lists and tables in variables are JSON.
# Byte sizes are integers or strings with a unit: "512MiB", "8GiB" (powers of
# 1024), "1.5GB" (powers of 1000).
# `deltafinctl reload` applies keys marked "live"; the others need a restart.
"""


def render_example_toml() -> str:
    """The example config: every section and key, documented, with defaults."""
    parts = [_HEADER]
    for name, field in Settings.model_fields.items():
        if name == "drives":
            parts.append(_drives(field))
            continue
        section = field.annotation
        assert isinstance(section, type) and issubclass(section, BaseModel)
        lines = [*_comment(field.description), f"[{name}]"]
        for key, sub in section.model_fields.items():
            lines += ["", *_key(name, key, sub)]
        parts.append("\n".join(lines) + "\n")
    return "\n".join(parts)


def _drives(field: FieldInfo) -> str:
    path = _example(DriveSettings.model_fields["path"])
    lines = [
        *_comment(field.description),
        f"# Restart. Env: DELTAFIND_DRIVES='[{{\"path\": \"{path}\"}}]'",
        "#",
        "# [[drives]]",
    ]
    for key, sub in DriveSettings.model_fields.items():
        lines += ["#", *_comment(sub.description)]
        value = None if sub.is_required() else sub.default
        lines.append(f"# {key} = {_toml(_example(sub) if value is None else value)}")
    return "\n".join(lines) + "\n"


def _key(section: str, key: str, field: FieldInfo) -> list[str]:
    reload = "Live" if is_live(field) else "Restart"
    env = f"DELTAFIND_{section.upper()}__{key.upper()}"
    default = field.get_default(
        call_default_factory=True
    )  # None: an unset key, shown commented out
    line = f"# {key} = {_toml(_example(field))}" if default is None else f"{key} = {_toml(default)}"
    return [*_comment(field.description), f"# {reload}. Env: {env}", line]


def _example(field: FieldInfo) -> Any:
    if not field.examples:
        raise AssertionError(f"field {field} has no default and no example to show")
    return field.examples[0]


def _comment(text: str | None) -> list[str]:
    assert text, "every settings field needs a description"
    return ["# " + line for line in textwrap.wrap(text, width=76, break_on_hyphens=False)]


def _toml(value: Any) -> str:
    """A TOML literal for a default or example value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, ByteSize):
        text = value.human()
        return text if text.isdigit() else json.dumps(text)
    if isinstance(value, FileMode):
        return json.dumps(f"{value:04o}")
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (str, PurePath)):
        return json.dumps(str(value))
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    raise TypeError(f"no TOML rendering for {value!r}")
