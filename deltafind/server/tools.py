"""Tool calling per model family: which markup a model speaks, its history and its forced-call grammar.

Owns the `ToolFormat`s (Hermes/Qwen `<tool_call>`, Llama 3 JSON, DeepSeek-V3 and
Kimi K2 section markers, Kimi K3 XTML calls), picking one from a tokenizer, the
OpenAI `tools`/`tool_choice` checks, putting tool calls and results of the history
into the shape chat templates read, and the Lark grammar that makes a required or
named call valid against its `parameters` schema. Parsing output: server/output.py.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from deltafind.server.errors import bad_request
from deltafind.server.structured import lark_json, lark_literal, lenient_schema

HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


@dataclass(frozen=True)
class ToolFormat:
    """How one family writes tool calls.

    section_open/close wrap all calls (None: calls stand alone); call_open starts
    each call and `header` (a regex from call_open on, group `name`) ends where the
    arguments' JSON object begins; `call_close` follows the arguments.
    """

    name: str
    call_open: str
    header: re.Pattern[str]
    call_close: str
    section_open: str | None = None
    section_close: str | None = None
    args_key: str = "arguments"

    @property
    def start(self) -> str:
        return self.section_open or self.call_open


HERMES = ToolFormat("hermes", "<tool_call>", re.compile(r'<tool_call>\s*\{\s*"name"\s*:\s*"(?P<name>[^"]+)"\s*,\s*"arguments"\s*:\s*(?=\{)'),
                    "</tool_call>")
LLAMA3 = ToolFormat("llama3", "{", re.compile(r'(?:<\|python_tag\|>)?\{\s*"name"\s*:\s*"(?P<name>[^"]+)"\s*,\s*"(?:parameters|arguments)"\s*:\s*(?=\{)'),
                    "}", args_key="parameters")
DEEPSEEK_V3 = ToolFormat("deepseek_v3", "<｜tool▁call▁begin｜>",
                         re.compile(r"<｜tool▁call▁begin｜>(?:function<｜tool▁sep｜>)?(?P<name>[^\n<｜]+?)(?:\n```json\n|<｜tool▁sep｜>)(?=\{)"),
                         "<｜tool▁call▁end｜>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
KIMI_K2 = ToolFormat("kimi_k2", "<|tool_call_begin|>",
                     re.compile(r"<\|tool_call_begin\|>\s*(?:functions\.)?(?P<name>[^:<\s]+)(?::\d+)?\s*<\|tool_call_argument_begin\|>\s*(?=\{)"),
                     "<|tool_call_end|>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
# K3 (docs/kimi-k3-format.md §6.6): `<|open|>call tool="NAME" index="N"<|sep|>`, then typed `argument` elements or one `json` element.
K3_XTML = ToolFormat("kimi_k3", "<|open|>call", re.compile(r'<\|open\|>call tool="(?P<name>[^"]*)" index="\d+"<\|sep\|>'),
                     "<|close|>call<|sep|>", "<|open|>tools<|sep|>", "<|close|>tools<|sep|>")
K3_JSON_OPEN, K3_JSON_CLOSE = '<|open|>json type="object"<|sep|>', "<|close|>json<|sep|>"
K3_ARGUMENT = re.compile(r'<\|open\|>argument key="(?P<key>[^"]*)" type="(?P<type>\w+)"<\|sep\|>(?P<value>.*?)<\|close\|>argument<\|sep\|>', re.S)


def pick_format(tokenizer: Any) -> tuple[ToolFormat, bool]:
    """(the format this model writes calls in, whether its chat template renders `tools` itself)."""
    if hasattr(tokenizer, "chat_segments"):
        return K3_XTML, True
    source = tokenizer.chat_template_source
    native = "tools" in source
    if tokenizer.token_to_id("<|tool_calls_section_begin|>") is not None:
        return KIMI_K2, native
    if tokenizer.token_to_id("<｜tool▁calls▁begin｜>") is not None:
        return DEEPSEEK_V3, native
    if native and "<tool_call>" not in source and ("<|python_tag|>" in source or '"parameters"' in source):
        return LLAMA3, native
    return HERMES, native and "<tool_call>" in source


# -- the request side ----------------------------------------------------------


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
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise bad_request(f'{where}: expected {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}',
                              where, "invalid_value")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.:-]{1,128}", name):
            raise bad_request(f"{where}.function.name: must be 1-128 letters, digits, _ . : - (got {name!r})",
                              f"{where}.function.name", "invalid_value")
        params = fn.get("parameters")
        params = {"type": "object", "properties": {}} if params is None else params
        if not isinstance(params, dict):
            raise bad_request(f"{where}.function.parameters: must be a JSON schema object", f"{where}.function.parameters",
                              "invalid_schema")
        params = lenient_schema(closed_objects(params), f"{where}.function.parameters")
        if any(t.name == name for t in out):
            raise bad_request(f"{where}.function.name: {name!r} is declared twice", f"{where}.function.name", "invalid_value")
        out.append(ToolSpec(name, params, tool, i))
    return out


def closed_objects(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on every object that lists `properties` and says nothing
    else: a forced call writes only declared arguments (and cannot ramble on with keys of its own)."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_objects(v) if k in ("items", "anyOf", "oneOf", "allOf", "prefixItems") else v for k, v in schema.items()}
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
            raise bad_request("tool_choice: 'required' needs at least one tool in `tools`", "tool_choice", "invalid_value")
        return choice, None
    name = None
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), dict) else choice.get("name")
    if not isinstance(name, str):
        raise bad_request('tool_choice: expected "auto", "none", "required" or {"type": "function", "function": {"name": ...}}',
                          "tool_choice", "invalid_value")
    if not any(t.name == name for t in tools):
        raise bad_request(f"tool_choice.function.name: {name!r} is not one of the tools given", "tool_choice.function.name",
                          "invalid_value")
    return "required", name


def call_grammar(fmt: ToolFormat, tokenizer: Any, tools: list[ToolSpec], parallel: bool, prefix: str = "") -> str:
    """Lark: one call (or several, `parallel`) of `tools` in `fmt`, arguments valid against their schemas."""

    def lit(text: str) -> str:  # a marker that is one token is matched as that token (special or not)
        tid = tokenizer.token_to_id(text)
        return f"<[{tid}]>" if tid is not None and len(text) > 1 else lark_literal(text)

    def k3(text: str) -> str:  # K3 markup: XTML markers are single tokens, the rest plain text
        parts = re.split(r"(<\|(?:open|close|sep)\|>)", text)
        return " ".join(lit(p) for p in parts if p)

    rules, alts = [], []
    for i, t in enumerate(tools):
        if fmt in (HERMES, LLAMA3):
            obj = _wrapped(t.parameters, t.name, fmt.args_key)
            body = (f'{lit("<tool_call>")} "\\n" {lark_json(obj)} "\\n" {lit("</tool_call>")}' if fmt is HERMES
                    else lark_json(obj))
        elif fmt is DEEPSEEK_V3:
            body = (f'{lit("<｜tool▁call▁begin｜>")} "function" {lit("<｜tool▁sep｜>")} {lark_literal(t.name)} "\\n```json\\n" '
                    f'{lark_json(t.parameters)} "\\n```" {lit("<｜tool▁call▁end｜>")}')
        elif fmt is KIMI_K2:
            body = (f'{lit("<|tool_call_begin|>")} {lark_literal("functions." + t.name)} ":" /[0-9]+/ '
                    f'{lit("<|tool_call_argument_begin|>")} {lark_json(t.parameters)} {lit("<|tool_call_end|>")}')
        else:  # K3: typed `argument` elements as the renderer writes them; else one `json` element (docs/kimi-k3-format.md §6.6)
            typed = _k3_arguments(t.parameters, k3)
            args = typed if typed is not None else f'{k3(K3_JSON_OPEN)} {lark_json(t.parameters)} {k3(K3_JSON_CLOSE)}'
            body = (f'{k3("<|open|>call")} {lark_literal(" tool=" + chr(34) + t.name + chr(34) + " index=")} "\\"" /[1-9][0-9]*/ "\\"" '
                    f'{k3("<|sep|>")} {args} {k3(K3_XTML.call_close)}')
        rules.append(f"call_{i}: {body}")
        alts.append(f"call_{i}")
    sep = ' "\\n" ' if fmt is HERMES else " "
    calls = f"call ({sep}call)*" if parallel and fmt is not LLAMA3 else "call"
    if fmt.section_open:
        open_, close = (k3, k3) if fmt is K3_XTML else (lit, lit)
        calls = f"{open_(fmt.section_open)} {calls} {close(fmt.section_close or '')}"
    lines = [f"start: {prefix} {calls}".replace("  ", " "), "call: " + " | ".join(alts), *rules]
    return "\n".join(lines)


def _wrapped(params: dict[str, Any], name: str, args_key: str) -> dict[str, Any]:
    """The `{"name": ..., "arguments": {...}}` object a Hermes/Llama 3 call writes, as one schema.

    `$ref`s point from the schema's root: its `$defs`/`definitions` (and lenient mark) move up to the new root.
    """
    hoist = ("$defs", "definitions", "x-guidance")
    inner = {k: v for k, v in params.items() if k not in hoist}
    return {"type": "object", "properties": {"name": {"const": name}, args_key: inner}, "required": ["name", args_key],
            "additionalProperties": False, **{k: params[k] for k in hoist if k in params}}


def _k3_arguments(params: dict[str, Any], k3: Any) -> str | None:
    """Lark for K3's typed `argument` elements of a flat schema, in its property order (None: not expressible,
    e.g. a string pattern or a union type; the call then takes the `json` element)."""
    required = set(params.get("required") or [])
    style = {k: params[k] for k in ("x-guidance",) if k in params}  # a lenient schema stays lenient in each argument
    parts = []
    for key, sub in (params.get("properties") or {}).items():
        if not isinstance(sub, dict) or re.search(r'[&"<>]', key) or "$ref" in json.dumps(sub):
            return None  # (a `$ref` points into the root's `$defs`, which only the `json` element keeps)
        kind = sub.get("type")
        if "enum" in sub and all(isinstance(v, str) for v in sub["enum"]) and kind in (None, "string"):
            kind, value = "string", "(" + " | ".join(lark_literal(v) for v in sub["enum"]) + ")"
        elif kind == "string" and not any(k in sub for k in ("pattern", "format", "const", "enum")):
            lo, hi = int(sub.get("minLength", 0)), sub.get("maxLength")
            value = f"/(?s:.{{{lo},{'' if hi is None else int(hi)}}})/"
        elif kind in ("integer", "number", "boolean", "object", "array", "null"):
            kind, value = {"integer": "number"}.get(kind, kind), lark_json({**sub, **style})
        else:
            return None
        elem = (f'{k3("<|open|>argument")} {lark_literal(f" key={chr(34)}{key}{chr(34)} type={chr(34)}{kind}{chr(34)}")} '
                f'{k3("<|sep|>")} {value} {k3("<|close|>argument<|sep|>")}')
        parts.append(f"({elem})" + ("" if key in required else "?"))
    return " ".join(parts) if parts else '""'


# -- the history side ------------------------------------------------------------


def arguments_object(args: Any, where: str) -> dict[str, Any]:
    """A tool call's `arguments` (a JSON string, as OpenAI sends them) as the object templates print."""
    if isinstance(args, dict):
        return args
    if args is None or (isinstance(args, str) and not args.strip()):
        return {}
    try:
        value = json.loads(args)
    except (TypeError, json.JSONDecodeError):
        raise bad_request(f"{where}: arguments are not valid JSON", where, "invalid_value") from None
    if not isinstance(value, dict):
        raise bad_request(f"{where}: arguments must be a JSON object", where, "invalid_value")
    return value


def template_messages(messages: list[dict[str, Any]], fmt: ToolFormat, native: bool, tools: list[ToolSpec]) -> list[dict[str, Any]]:
    """OpenAI messages -> what the chat template reads: call arguments as objects; and for a template
    without tool support, the Hermes tool prompt in the system message and calls/results as text."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for j, c in enumerate(m["tool_calls"]):
                fn = dict(c.get("function") or {})
                fn["arguments"] = arguments_object(fn.get("arguments"), f"messages[{i}].tool_calls[{j}].function.arguments")
                calls.append({**c, "function": fn})
            m["tool_calls"] = calls
        if native or fmt is not HERMES:
            out.append(m)
            continue
        if m.get("tool_calls"):  # a template without tools: the calls become the Hermes text the model wrote,
            # with the arguments as the client sent them back (our own output, verbatim) so the tokens repeat
            raw = [(c["function"].get("name"), (messages[i].get("tool_calls") or [])[j].get("function", {}).get("arguments"))
                   for j, c in enumerate(m.pop("tool_calls"))]
            text = "".join(f'\n<tool_call>\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '
                           f'{args if isinstance(args, str) and args.strip() else json.dumps(args or {}, ensure_ascii=False)}}}\n</tool_call>'
                           for name, args in raw)
            m["content"] = ((m.get("content") or "") + text).lstrip("\n") if m.get("content") else text.lstrip("\n")
        if m.get("role") == "tool":
            body = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("role") == "user" and str(out[-1].get("content", "")).endswith("</tool_response>"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + body}
            else:
                out.append({"role": "user", "content": body})
            continue
        out.append(m)
    if tools and not native and fmt is HERMES:
        prompt = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t.raw, ensure_ascii=False) for t in tools))
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{prompt}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
