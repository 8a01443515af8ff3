"""A Responses API request as the chat request it means: fields, tools, `input` items, reasoning blobs.

Owns what /v1/responses accepts (the README says which fields are honoured and which
accepted without effect), the tool types (functions; a `namespace`'s functions offered as
`NAMESPACE.NAME`; hosted tools this server cannot run dropped with a log line) and the
`encrypted_content` of reasoning items, which carries the reasoning text back to this server.
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

from deltafind.log import get_logger
from deltafind.server.errors import ApiError, bad_request

log = get_logger(__name__)
PASSED = {
    "model",
    "temperature",
    "top_p",
    "stream",
    "parallel_tool_calls",
    "user",
    "metadata",
    "tool_choice",
}
# Accepted and without effect here (storage, tracing, caching hints, client bookkeeping).
IGNORED = {
    "store",
    "include",
    "truncation",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
    "background",
    "stream_options",
    "max_tool_calls",
    "prompt_cache_retention",
    "top_logprobs",
    "conversation",
    "prompt",
    "client_metadata",
}
KNOWN = (
    PASSED
    | IGNORED
    | {
        "input",
        "instructions",
        "tools",
        "max_output_tokens",
        "text",
        "reasoning",
        "previous_response_id",
    }
)
# The reference API's hosted tools: it runs them itself; a server that cannot offers the model the rest.
HOSTED = {
    "web_search",
    "web_search_preview",
    "web_search_2025_08_26",
    "web_search_preview_2025_03_11",
    "file_search",
    "computer",
    "computer_use",
    "computer_use_preview",
    "code_interpreter",
    "image_generation",
    "mcp",
    "local_shell",
    "shell",
    "apply_patch",
    "custom",
    "tool_search",
}
BLOB_PREFIX = (
    "dfr1:"  # version 1: base64 of {"text": reasoning}; not secret (the client sent the prompt)
)


def seal_reasoning(text: str) -> str:
    """A reasoning item's `encrypted_content`: the text, so a `store: false` client can replay it."""
    return (
        BLOB_PREFIX
        + base64.b64encode(json.dumps({"text": text}, ensure_ascii=False).encode()).decode()
    )


def open_reasoning(blob: Any, where: str) -> str:
    """The reasoning text of an `encrypted_content` this server wrote, or a 400 naming the item."""
    if isinstance(blob, str) and blob.startswith(BLOB_PREFIX):
        try:
            text = json.loads(base64.b64decode(blob[len(BLOB_PREFIX) :], validate=True))["text"]
            if isinstance(text, str):
                return text
        except (binascii.Error, ValueError, KeyError, TypeError):
            pass
    raise bad_request(
        f"{where}: this encrypted_content was not written by this server (send reasoning items back "
        "as this server returned them, or drop them)",
        where,
        "invalid_encrypted_content",
    )


def _text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_request(
            f"{where}: expected a string or a list of text parts", where, "invalid_value"
        )
    out = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in (
            "input_text",
            "output_text",
            "text",
            "refusal",
            "reasoning_text",
            "summary_text",
        ):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(
                f"{where}[{j}]: {kind!r} content is not supported (text only)",
                f"{where}[{j}].type",
                "unsupported_content",
            )
        key = "refusal" if part["type"] == "refusal" else "text"
        value = part.get(key)
        if not isinstance(value, str):
            raise bad_request(
                f"{where}[{j}].{key}: expected a string", f"{where}[{j}].{key}", "invalid_value"
            )
        out.append(value)
    return "".join(out)


def _string(item: dict[str, Any], key: str, where: str, required: bool = True) -> str | None:
    value = item.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key}: expected a string", f"{where}.{key}", "invalid_value")
    return value


def call_name(name: str, namespace: str | None) -> str:
    """The function name the model sees for a namespaced tool (and writes in its calls)."""
    return f"{namespace}.{name}" if namespace else name


def namespaced(tools: Any) -> dict[str, tuple[str, str]]:
    """The name the model sees for each namespaced function -> (namespace, name), to split its calls again."""
    out = {}
    for t in tools if isinstance(tools, list) else []:
        if (
            isinstance(t, dict)
            and t.get("type") == "namespace"
            and isinstance(t.get("tools"), list)
        ):
            for f in t["tools"]:
                if isinstance(f, dict) and isinstance(f.get("name"), str):
                    out[call_name(f["name"], t["name"])] = (t["name"], f["name"])
    return out


def to_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """`instructions` and `input` items as chat messages (calls joined onto their assistant turn)."""
    msgs: list[dict[str, Any]] = []
    if body.get("instructions"):
        msgs.append({"role": "system", "content": _text(body["instructions"], "instructions")})
    items = body.get("input")
    if isinstance(items, str):
        return [*msgs, {"role": "user", "content": items}]
    if not isinstance(items, list):
        raise bad_request("input: expected a string or a list of items", "input", "invalid_value")
    reasoning = None
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where}: expected an object", where, "invalid_value")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(
                    f"{where}.role: {role!r} is not one of user, assistant, system, developer",
                    f"{where}.role",
                    "invalid_value",
                )
            msg = {"role": role, "content": _text(item.get("content"), f"{where}.content")}
            if role == "assistant" and reasoning is not None:
                msg["reasoning_content"], reasoning = reasoning, None
            msgs.append(msg)
        elif kind == "function_call":
            name = call_name(
                _string(item, "name", where), _string(item, "namespace", where, required=False)
            )  # type: ignore[arg-type]
            args = _string(item, "arguments", where, required=False) or "{}"
            call_id = _string(item, "call_id", where, required=False) or _string(
                item, "id", where, required=False
            )
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": args},
            }
            last = msgs[-1] if msgs else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": ""}
                if reasoning is not None:
                    last["reasoning_content"], reasoning = reasoning, None
                msgs.append(last)
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            out = item.get("output")
            msgs.append(
                {
                    "role": "tool",
                    "tool_call_id": _string(item, "call_id", where, required=False),
                    "content": out if isinstance(out, str) else _text(out, f"{where}.output"),
                }
            )
        elif kind == "reasoning":
            if item.get("encrypted_content") is not None:
                reasoning = open_reasoning(item["encrypted_content"], f"{where}.encrypted_content")
            elif item.get("content"):
                reasoning = _text(item["content"], f"{where}.content")
            else:
                reasoning = _text(item.get("summary") or [], f"{where}.summary")
        else:
            raise bad_request(
                f"{where}.type: {kind!r} items are not supported (message, function_call, "
                "function_call_output, reasoning)",
                f"{where}.type",
                "unsupported_parameter",
            )
    return msgs


def _function(t: dict[str, Any], where: str, namespace: str | None = None) -> dict[str, Any]:
    fn = {k: t[k] for k in ("description", "parameters", "strict") if k in t}
    fn["name"] = call_name(_string(t, "name", where), namespace)  # type: ignore[arg-type]
    return {"type": "function", "function": fn}


def to_tools(tools: Any) -> list[dict[str, Any]]:
    """Chat `tools` for Responses tools: functions, a namespace's functions, hosted tools left out (logged)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad_request("tools: expected a list of tools", "tools", "invalid_value")
    out, skipped = [], []
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        kind = t.get("type") if isinstance(t, dict) else None
        if kind == "function":
            out.append(_function(t, where))
        elif kind == "namespace":
            ns = _string(t, "name", where)
            inner = t.get("tools")
            if not isinstance(inner, list):
                raise bad_request(
                    f"{where}.tools: expected a list of function tools",
                    f"{where}.tools",
                    "invalid_value",
                )
            for j, f in enumerate(inner):
                if isinstance(f, dict) and f.get("type") == "function":
                    out.append(_function(f, f"{where}.tools[{j}]", ns))
                else:
                    skipped.append(f"{ns}.{f.get('type') if isinstance(f, dict) else f!r}")
        elif kind in HOSTED:
            skipped.append(kind)
        else:
            raise bad_request(
                f"{where}.type: {kind!r} is not a tool type (function, namespace, or a hosted tool such as "
                "web_search)",
                f"{where}.type",
                "invalid_value",
            )
    if skipped:  # the reference API runs these itself; here the model is not offered them
        log.info("hosted_tools_ignored", tools=skipped)
    return out


def to_chat(body: dict[str, Any], history: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat completions request equivalent to a Responses request."""
    for key in body:
        if key not in KNOWN:
            raise ApiError(
                400, f"Unrecognized request argument supplied: {key}", key, "unknown_parameter"
            )
    chat = {k: body[k] for k in PASSED if body.get(k) is not None}
    chat["messages"] = [*history, *to_messages(body)]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    tools = to_tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    choice = chat.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        chat["tool_choice"] = {
            "type": "function",
            "function": {"name": call_name(choice["name"], choice.get("namespace"))},
        }
    elif not tools and choice in ("auto", "none"):
        del chat["tool_choice"]  # every tool was hosted: nothing left to choose from
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt},
        }
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        chat["response_format"] = {"type": "json_object"}
    effort = (
        (body.get("reasoning") or {}).get("effort")
        if isinstance(body.get("reasoning"), dict)
        else None
    )
    if effort is not None:
        chat["reasoning_effort"] = effort
    return chat
