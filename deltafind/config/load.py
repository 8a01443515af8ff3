"""Build `Settings` from a TOML file, DELTAFIND_* variables and overrides.

The only place deltafind reads its config file or DELTAFIND_* variables.
Every problem becomes one line of a `ConfigError`: where the value came from
(file, variable or override), the dotted key, what is allowed and what was
given.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tomli
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import SettingsError

from deltafind.config.schema import _FILE_DATA, Settings
from deltafind.errors import ConfigError

DEFAULT_CONFIG_PATH = Path("/etc/deltafind/deltafind.toml")
ENV_PREFIX = "DELTAFIND_"


def load_settings(
    path: Path | str | None = None, overrides: Mapping[str, Any] | None = None
) -> Settings:
    """Load, merge and validate the settings.

    Args:
        path: TOML file to read. None reads `DEFAULT_CONFIG_PATH` if it
            exists and uses the built-in defaults otherwise.
        overrides: nested values that beat everything else, e.g. CLI flags as
            `{"model": {"store": "/x"}}`; None values are dropped (unset flags).

    Raises:
        ConfigError: naming the file, variable or override, the key, the bad
            value and what is allowed, one line per problem.
    """
    path = config_path(path)
    data = _read_toml(Path(path)) if path is not None else {}
    kept = _drop_none(dict(overrides or {}))
    token = _FILE_DATA.set(data)
    try:
        return Settings(**kept)
    except ValidationError as e:
        lines = [_describe(err, path, data, kept) for err in e.errors(include_url=False)]
        raise ConfigError("\n".join(lines)) from None
    except SettingsError as e:
        raise ConfigError(_describe_env_error(e)) from None
    finally:
        _FILE_DATA.reset(token)


def config_path(given: Path | str | None) -> Path | None:
    """The config file a command reads: the one given, else DEFAULT_CONFIG_PATH when it exists, else
    None (the built-in defaults). The one place this rule lives."""
    if given is not None:
        return Path(given)
    return DEFAULT_CONFIG_PATH if _exists(DEFAULT_CONFIG_PATH) else None


def _exists(path: Path) -> bool:
    try:
        path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        return True  # unreadable: let _read_toml say so rather than fall back to defaults
    return True


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomli.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except tomli.TOMLDecodeError as e:
        where = f"line {e.lineno}, column {e.colno}"
        raise ConfigError(f"{path}: {where}: invalid TOML: {e.msg}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: byte {e.start}: invalid TOML: not UTF-8 text") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config file: {e.strerror or e}") from None


def _drop_none(values: dict[str, Any]) -> dict[str, Any]:
    return {
        key: _drop_none(dict(value)) if isinstance(value, Mapping) else value
        for key, value in values.items()
        if value is not None
    }


# -- error messages ---------------------------------------------------------

_TYPE_HELP = {
    "int_type": "expected an integer",
    "int_parsing": "expected an integer",
    "int_from_float": "expected an integer",
    "float_type": "expected a number",
    "float_parsing": "expected a number",
    "bool_type": "expected true or false",
    "bool_parsing": "expected true or false",
    "string_type": "expected a string",
    "path_type": "expected a path (a string)",
    "list_type": "expected a list (a TOML array)",
    "missing": "required key is missing",
}
_BOUNDS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")


def _describe(err: Mapping[str, Any], path: Path | str | None, data: dict, overrides: dict) -> str:
    loc = tuple(err["loc"])
    field, owner = _field_at(loc)
    kind = err["type"]
    if kind == "extra_forbidden":
        what = "section" if owner is Settings else "key"
        valid = ", ".join(owner.model_fields) if owner else ""
        where = f" in [{_dotted([p for p in loc[:-1] if isinstance(p, str)])}]"
        where = where if owner is not Settings else ""
        message = f"unknown {what}; valid {what}s{where}: {valid}"
    elif kind in ("model_type", "dict_type", "model_attributes_type"):
        message = f"expected a table ([{_dotted(loc)}] in TOML)"
    elif kind == "literal_error":
        message = f"expected one of {err['ctx']['expected']}"
    elif kind in _BOUNDS and field is not None:
        message = _bounds_help(field)
    elif kind in _TYPE_HELP:
        message = _TYPE_HELP[kind]
    else:
        message = str(err["msg"]).removeprefix("Value error, ")
        message = message.replace("Input should be", "expected", 1)
    line = f"{_source(loc, path, data, overrides)}: {_dotted(loc) or 'settings'}: {message}"
    if kind != "missing":
        secret = field is not None and (field.json_schema_extra or {}).get("secret") is True
        line += " (got <hidden>)" if secret else f" (got {_show(err.get('input'))})"
    return line


def _field_at(loc: Sequence[str | int]) -> tuple[FieldInfo | None, type[BaseModel] | None]:
    """The field a location names and the model that owns it (None when unknown)."""
    model: type[BaseModel] | None = Settings
    field = owner = None
    for part in loc:
        if isinstance(part, int):
            continue
        if model is None:
            return None, None
        owner, field = model, model.model_fields.get(part)
        if field is None:
            return None, owner
        model = _model_in(field.annotation)
    return field, owner


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _bounds_help(field: FieldInfo) -> str:
    bounds = {  # from annotated_types.Ge(ge=1) and friends
        name: getattr(meta, name)
        for meta in field.metadata
        for name in ("ge", "gt", "le", "lt")
        if getattr(meta, name, None) is not None
    }
    noun = "a number" if "float" in str(field.annotation) else "an integer"
    if "ge" in bounds and "le" in bounds:
        return f"expected {noun} from {bounds['ge']} to {bounds['le']}"
    words = {"ge": "at least", "gt": "greater than", "le": "at most", "lt": "less than"}
    return f"expected {noun} " + " and ".join(f"{words[k]} {v}" for k, v in bounds.items())


def _source(loc: tuple, path: Path | str | None, data: dict, overrides: dict) -> str:
    """Name where the value at `loc` came from: the deepest match, overrides first."""
    env = {k.lower(): k for k in os.environ if k.upper().startswith(ENV_PREFIX)}
    for depth in range(len(loc), 0, -1):
        if _has(overrides, loc[:depth]):
            return "override"
        names = [p for p in loc[:depth] if isinstance(p, str)]
        var = env.get((ENV_PREFIX + "__".join(names)).lower()) if len(names) == depth else None
        if var is not None:
            return f"environment variable {var}"
        if _has(data, loc[:depth]):
            return str(path)
    return str(path) if path is not None else "settings"


def _has(tree: Any, loc: Sequence[str | int]) -> bool:
    for part in loc:
        in_table = isinstance(tree, Mapping) and isinstance(part, str) and part in tree
        in_list = isinstance(tree, list) and isinstance(part, int) and 0 <= part < len(tree)
        if in_table or in_list:
            tree = tree[part]
        else:
            return False
    return True


def _dotted(loc: Sequence[str | int]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _describe_env_error(e: SettingsError) -> str:
    field = re.search(r'field "(\w+)"', str(e))
    start = ENV_PREFIX + (field.group(1).upper() if field else "")
    names = sorted(k for k in os.environ if k.upper().startswith(start))
    cause = f" ({e.__cause__})" if e.__cause__ else ""
    return (
        f"environment variables {', '.join(names) or '(none)'}: {e}{cause}; lists and tables "
        'in DELTAFIND_* variables are JSON, e.g. DELTAFIND_SERVER__API_KEYS=\'["key"]\''
    )
