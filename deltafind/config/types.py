"""Value types of the settings schema: byte sizes and octal file modes.

Both are `int` subclasses, so code uses them as plain numbers; they parse the
strings people write in TOML ("8GiB", "0600") and render back to them.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

from pydantic import GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import core_schema

# Decimal units are powers of 1000, binary (…i, …iB) powers of 1024, as in
# Kubernetes quantities: "1.5GB" is 1_500_000_000, "8GiB" is 8 * 2**30.
_UNITS = {"": 1, "b": 1}
for _exp, _letter in enumerate("kmgtp", start=1):
    _UNITS[_letter] = _UNITS[f"{_letter}b"] = 1000**_exp
    _UNITS[f"{_letter}i"] = _UNITS[f"{_letter}ib"] = 1024**_exp
_BYTES_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")
_RENDER = [(1024**e, f"{u}iB") for e, u in zip(range(5, 0, -1), "PTGMK", strict=True)] + [
    (1000**e, f"{u}B") for e, u in zip(range(5, 0, -1), "PTGMK", strict=True)
]
_MAX_BYTES = 2**63 - 1
BYTE_SIZE_HELP = "expected a byte size like 8GiB or an integer"


def parse_byte_size(value: object) -> int:
    """Return the number of bytes `value` means.

    Accepts a non-negative integer, an integral float, or a string such as
    "512", "64MiB", "8GiB", "1.5GB" (units case-insensitive; K/M/G/T/P and
    KB… are decimal, KiB… binary). Raises ValueError saying what is allowed.
    """
    if isinstance(value, bool):
        raise ValueError(BYTE_SIZE_HELP)
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"{BYTE_SIZE_HELP}; a number of bytes must be whole")
        value = int(value)
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        match = _BYTES_RE.fullmatch(value)
        if not match:
            raise ValueError(BYTE_SIZE_HELP)
        unit = _UNITS.get(match.group(2).lower())
        if unit is None:
            raise ValueError(
                f"{BYTE_SIZE_HELP}; units are B, KB..PB (powers of 1000), KiB..PiB (powers of 1024)"
            )
        try:
            exact = Decimal(match.group(1)) * unit
        except InvalidOperation:  # pragma: no cover - the regex admits only numbers
            raise ValueError(BYTE_SIZE_HELP) from None
        if exact != exact.to_integral_value():
            raise ValueError(f"{BYTE_SIZE_HELP}; {value!r} is not a whole number of bytes")
        n = int(exact)
    else:
        raise ValueError(BYTE_SIZE_HELP)
    if n < 0:
        raise ValueError(f"{BYTE_SIZE_HELP}; sizes cannot be negative")
    if n > _MAX_BYTES:
        raise ValueError(f"{BYTE_SIZE_HELP}; at most {_MAX_BYTES} bytes")
    return n


class _ParsedInt(int):
    """An `int` that pydantic fields build with the subclass's `_parse` and serialize to a plain integer in JSON."""

    @staticmethod
    def _parse(value: object) -> int:
        raise NotImplementedError

    @classmethod
    def _validate(cls, value: object) -> _ParsedInt:
        return value if type(value) is cls else int.__new__(cls, cls._parse(value))

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.no_info_plain_validator_function(
            cls._validate,
            serialization=core_schema.plain_serializer_function_ser_schema(int, when_used="json"),
        )


class ByteSize(_ParsedInt):
    """A number of bytes that parses and renders human units.

    `ByteSize("8GiB") == 8 * 2**30`; `ByteSize(2**30).human() == "1GiB"`.
    As a pydantic field it accepts whatever `parse_byte_size` does and
    serializes to a plain integer in JSON.
    """

    _parse = staticmethod(parse_byte_size)

    def __new__(cls, value: object = 0) -> ByteSize:
        try:
            return super().__new__(cls, parse_byte_size(value))
        except ValueError as e:
            raise ValueError(f"{e} (got {value!r})") from None

    def human(self) -> str:
        """The shortest exact spelling: "4GiB", "1500MB", or digits."""
        for unit, name in _RENDER:
            if self and self % unit == 0:
                return f"{self // unit}{name}"
        return str(int(self))

    def __repr__(self) -> str:
        return f"ByteSize({self.human()!r})"

    @classmethod
    def __get_pydantic_json_schema__(
        cls, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        return {
            "anyOf": [
                {"type": "integer", "minimum": 0},
                {"type": "string", "pattern": f"^{_BYTES_RE.pattern}$", "examples": ["8GiB"]},
            ]
        }


FILE_MODE_HELP = 'expected a file mode from 0 to 0o777, written as a string like "0600" or as 0o600'


class FileMode(_ParsedInt):
    """Unix permission bits (0..0o777); strings are read as octal ("0600")."""

    def __new__(cls, value: object = 0o600) -> FileMode:
        return int.__new__(cls, cls._parse(value))

    @staticmethod
    def _parse(value: object) -> int:
        if isinstance(value, str) and re.fullmatch(r"(0o?)?[0-7]{1,4}", value.strip(), re.I):
            value = int(value.strip().lower().removeprefix("0o") or "0", 8)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 0o777:
            raise ValueError(FILE_MODE_HELP)
        return value

    def __repr__(self) -> str:
        return f"FileMode('{self:04o}')"

    @classmethod
    def __get_pydantic_json_schema__(
        cls, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        return {
            "anyOf": [
                {"type": "integer", "minimum": 0, "maximum": 0o777},
                {"type": "string", "pattern": "^(0o?)?[0-7]{1,4}$"},
            ]
        }
