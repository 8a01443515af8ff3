"""A request's tools: the OpenAI `tools` and `tool_choice` checked, each tool's schema made enforceable.

How a model writes calls, reads results and is held to a call's schema belongs
to its chat format (server/formats); this is what every format is handed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from deltafind.server.errors import bad_request
from deltafind.server.structured import lenient_schema


@dataclass(frozen=True)
class ToolSpec:
    name: str
    parameters: dict[str, Any]
    raw: dict[str, Any]  # the tool as the client sent it (templates read it whole)
    index: int = 0  # its place in `tools`

    @property
    def field(self) -> str:
        return f"tools[{self.index}].function.parameters"


def check_tools(tools: list[Any] | None) -> list[ToolSpec]:
    """OpenAI `tools` -> specs, or a 400 naming the bad entry."""
    out: list[ToolSpec] = []
    for i, tool in enumerate(tools or []):
        where = f"tools[{i}]"
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(tool.get("function"), dict)
        ):
            raise bad_request(
                f'{where}: expected {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}',
                where,
                "invalid_value",
            )
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.:-]{1,128}", name):
            raise bad_request(
                f"{where}.function.name: must be 1-128 letters, digits, _ . : - (got {name!r})",
                f"{where}.function.name",
                "invalid_value",
            )
        params = fn.get("parameters")
        params = {"type": "object", "properties": {}} if params is None else params
        if not isinstance(params, dict):
            raise bad_request(
                f"{where}.function.parameters: must be a JSON schema object",
                f"{where}.function.parameters",
                "invalid_schema",
            )
        params = lenient_schema(closed_objects(params), f"{where}.function.parameters")
        if any(t.name == name for t in out):
            raise bad_request(
                f"{where}.function.name: {name!r} is declared twice",
                f"{where}.function.name",
                "invalid_value",
            )
        out.append(ToolSpec(name, params, tool, i))
    return out


def closed_objects(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object that lists `properties` and says nothing
    else: a forced call writes only declared arguments (and cannot ramble on with keys of its own)."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        k: closed_objects(v) if k in ("items", "anyOf", "oneOf", "allOf", "prefixItems") else v
        for k, v in schema.items()
    }
    for key in ("properties", "$defs", "definitions"):  # maps of name -> schema
        if isinstance(schema.get(key), dict):
            out[key] = {k: closed_objects(v) for k, v in schema[key].items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def check_tool_choice(choice: Any, tools: list[ToolSpec]) -> tuple[str, str | None]:
    """(mode: auto | none | required, the forced function's name or None)."""
    if choice is None:
        return ("auto" if tools else "none"), None
    if choice in ("auto", "none", "required"):
        if choice == "required" and not tools:
            raise bad_request(
                "tool_choice: 'required' needs at least one tool in `tools`",
                "tool_choice",
                "invalid_value",
            )
        return choice, None
    name = None
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (
            (choice.get("function") or {}).get("name")
            if isinstance(choice.get("function"), dict)
            else choice.get("name")
        )
    if not isinstance(name, str):
        raise bad_request(
            'tool_choice: expected "auto", "none", "required" or {"type": "function", "function": {"name": ...}}',
            "tool_choice",
            "invalid_value",
        )
    if not any(t.name == name for t in tools):
        raise bad_request(
            f"tool_choice.function.name: {name!r} is not one of the tools given",
            "tool_choice.function.name",
            "invalid_value",
        )
    return "required", name
