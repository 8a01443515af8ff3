"""An Anthropic Messages request -> the equivalent OpenAI chat request (what /v1/messages runs through).

Owns checking every field's JSON type (a 400 naming the field, never a 500),
content blocks (text, tool_use, tool_result, thinking), system messages (top-level
and mid-conversation), `thinking` and `output_config`, and the fields a server
without the feature accepts and ignores (README "Claude Code"). No wire output here.
"""

from __future__ import annotations

import json
from typing import Any

from deltafind.log import get_logger
from deltafind.server.errors import bad_request

log = get_logger(__name__)

KNOWN = {
    "model",
    "messages",
    "system",
    "max_tokens",
    "tools",
    "tool_choice",
    "temperature",
    "top_p",
    "top_k",
    "stop_sequences",
    "stream",
    "metadata",
    "thinking",
    "service_tier",
    "container",
    "mcp_servers",
    "context_management",
    "output_config",
    "cache_control",
}
# Anthropic's effort levels -> the chat path's reasoning_effort (K3 takes low/high/max: server/formats/kimi_k3.py rounds).
EFFORT = {"low": "low", "medium": "medium", "high": "high", "xhigh": "max", "max": "max"}


def _want(value: Any, types: type | tuple[type, ...], where: str, what: str) -> Any:
    # bool is an int in Python, never in JSON Schema: `max_tokens: true` is a wrong type.
    if not isinstance(value, types) or (
        isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,))
    ):
        raise bad_request(
            f"{where}: expected {what} (got {json.dumps(value)[:60]})", where, "invalid_type"
        )
    return value


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    _want(content, list, where, "a string or a list of content blocks")
    for j, b in enumerate(content):
        _want(b, dict, f"{where}[{j}]", "a content block object")
        _want(b.get("type"), str, f"{where}[{j}].type", "a block type string")
    return content


def _text(block: dict[str, Any], where: str) -> str:
    return _want(block.get("text"), str, f"{where}.text", "a string")


def _block_text(content: Any, where: str) -> str:
    parts = []
    for j, b in enumerate(_blocks(content if content is not None else "", where)):
        if b["type"] != "text":
            raise bad_request(
                f"{where}[{j}]: only text blocks are supported here (got {b['type']!r})",
                f"{where}[{j}].type",
            )
        parts.append(_text(b, f"{where}[{j}]"))
    return "".join(parts)


BILLING = "x-anthropic-billing-header:"  # Claude Code's first system block: attribution for Anthropic's billing


def _system(content: Any) -> str:
    """The top-level `system` text, without Claude Code's billing header (README "Claude Code"): a hash of
    the request that changes between requests and sessions, at position 0, so it would defeat every
    prefix reuse; it is addressed to Anthropic's billing, not to the model."""
    if isinstance(content, list):
        content = [
            b
            for b in content
            if not (
                isinstance(b, dict)
                and isinstance(b.get("text"), str)
                and b["text"].startswith(BILLING)
            )
        ]
    elif isinstance(content, str) and content.startswith(BILLING):
        content = content.split("\n", 1)[1] if "\n" in content else ""
    return _block_text(content, "system")


def _system_in_messages(messages: list[Any], i: int) -> None:
    """Anthropic's placement rules for a `role: "system"` message (a 400 where it answers one)."""
    where = f"messages[{i}]"
    before = messages[i - 1].get("role") if i else None
    after = (
        messages[i + 1].get("role")
        if i + 1 < len(messages) and isinstance(messages[i + 1], dict)
        else None
    )
    if before != "user":
        raise bad_request(
            f"{where}: a system message must follow a user message (put instructions for the start in `system`)",
            f"{where}.role",
        )
    if after not in (None, "assistant"):
        raise bad_request(
            f"{where}: a system message must be the last message or be followed by an assistant message",
            f"{where}.role",
        )


def _message(m: dict[str, Any], where: str, out: list[dict[str, Any]]) -> None:
    role = m["role"]
    # an instruction from this point on: a system turn at its place in the conversation
    if role == "system":
        out.append({"role": "system", "content": _block_text(m.get("content"), f"{where}.content")})
        return
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    thinking = None
    for j, b in enumerate(_blocks(m.get("content"), f"{where}.content")):
        at, kind = f"{where}.content[{j}]", b["type"]
        if kind == "text":
            text.append(_text(b, at))
        elif kind == "tool_use" and role == "assistant":
            _want(b.get("id"), str, f"{at}.id", "a string")
            _want(b.get("name"), str, f"{at}.name", "a string")
            args = _want(b.get("input", {}), dict, f"{at}.input", "an object")
            calls.append(
                {
                    "id": b["id"],
                    "type": "function",
                    "function": {
                        "name": b["name"],
                        "arguments": json.dumps(args, ensure_ascii=False),
                    },
                }
            )
        elif kind == "tool_result" and role == "user":
            _want(b.get("tool_use_id"), str, f"{at}.tool_use_id", "a string")
            result = b.get("content")
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": b["tool_use_id"],
                    "content": result
                    if isinstance(result, str)
                    else _block_text(result, f"{at}.content"),
                }
            )
        elif kind == "thinking" and role == "assistant":
            thinking = _want(b.get("thinking"), str, f"{at}.thinking", "a string")
        elif kind == "redacted_thinking" and role == "assistant":
            pass  # opaque to a server that never wrote one: nothing to replay
        else:
            raise bad_request(
                f"{at}.type: {kind!r} blocks are not supported in {role} messages", f"{at}.type"
            )
    if text or calls or role == "assistant":
        msg = {
            "role": role,
            "content": "".join(text),
            "tool_calls": calls,
            "reasoning_content": thinking,
        }
        out.append({k: v for k, v in msg.items() if v or k == "content"})


def _tools(tools: Any) -> list[dict[str, Any]]:
    out = []
    for i, t in enumerate(_want(tools, list, "tools", "a list of tools")):
        where = f"tools[{i}]"
        _want(t, dict, where, "a tool object")
        # a server tool (web_search_..., bash_...): Anthropic runs it, we cannot
        if t.get("type") not in (
            None,
            "custom",
        ):
            log.info(
                "server_tool_ignored", tool=str(t.get("type"))[:64], name=str(t.get("name"))[:64]
            )
            continue
        _want(t.get("name"), str, f"{where}.name", "a string")
        _want(t.get("description", ""), str, f"{where}.description", "a string")
        schema = _want(t.get("input_schema"), dict, f"{where}.input_schema", "a JSON schema object")
        out.append(
            {
                "type": "function",
                "function": {
                    "name": t["name"],
                    "description": t.get("description", ""),
                    "parameters": schema,
                },
            }
        )
    return out


def _tool_choice(choice: Any, chat: dict[str, Any]) -> None:
    _want(choice, dict, "tool_choice", 'an object like {"type": "auto"}')
    kind = choice.get("type")
    if kind == "tool":
        _want(choice.get("name"), str, "tool_choice.name", "a string")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif kind in ("auto", "any", "none"):
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    else:
        raise bad_request(
            f"tool_choice.type: expected auto, any, tool or none (got {json.dumps(kind)[:40]})",
            "tool_choice.type",
        )
    if _want(
        choice.get("disable_parallel_tool_use", False),
        bool,
        "tool_choice.disable_parallel_tool_use",
        "true or false",
    ):
        chat["parallel_tool_calls"] = False


def _thinking(body: dict[str, Any], chat: dict[str, Any]) -> None:
    thinking = body.get("thinking")
    if thinking is not None:
        kind = _want(thinking, dict, "thinking", 'an object like {"type": "adaptive"}').get("type")
        # no separate thinking budget here: max_tokens bounds thinking and answer together
        if kind == "enabled":
            budget = _want(
                thinking.get("budget_tokens"), int, "thinking.budget_tokens", "an integer"
            )
            if budget < 1024 or budget >= chat["max_tokens"]:
                raise bad_request(
                    "thinking.budget_tokens: must be >= 1024 and less than max_tokens",
                    "thinking.budget_tokens",
                )
        elif kind == "disabled":
            chat["chat_template_kwargs"] = {"enable_thinking": False}
        elif kind != "adaptive":
            raise bad_request(
                f"thinking.type: expected enabled, disabled or adaptive (got {json.dumps(kind)[:40]})",
                "thinking.type",
            )
    config = body.get("output_config")
    if config is None:
        return
    _want(config, dict, "output_config", "an object")
    for key in config:
        if key not in ("effort", "format"):
            raise bad_request(
                f"output_config.{key}: Extra inputs are not permitted", f"output_config.{key}"
            )
    if "effort" in config:
        effort = config["effort"]
        if effort not in EFFORT:
            raise bad_request(
                f"output_config.effort: expected one of {', '.join(EFFORT)} (got {json.dumps(effort)[:40]})",
                "output_config.effort",
            )
        chat["reasoning_effort"] = EFFORT[effort]
    fmt = config.get("format")
    # structured output: the same enforced JSON schema as OpenAI's response_format
    if fmt is not None:
        _want(
            fmt,
            dict,
            "output_config.format",
            'an object like {"type": "json_schema", "schema": {...}}',
        )
        if fmt.get("type") != "json_schema":
            raise bad_request(
                "output_config.format.type: only json_schema is supported",
                "output_config.format.type",
            )
        schema = _want(
            fmt.get("schema"), dict, "output_config.format.schema", "a JSON schema object"
        )
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": schema},
        }


def to_chat(body: dict[str, Any], count_only: bool = False) -> dict[str, Any]:
    """The chat completions request equivalent to an Anthropic Messages request.

    `count_only`: for /v1/messages/count_tokens, which takes no max_tokens or stream.
    """
    for key in body:
        if key not in KNOWN:
            raise bad_request(f"{key}: Extra inputs are not permitted", key)
    _want(body.get("model"), str, "model", "a model name string")
    max_tokens = (
        1
        if count_only
        else _want(body.get("max_tokens"), int, "max_tokens", "an integer (required)")
    )
    if max_tokens < 1:
        raise bad_request("max_tokens: must be at least 1", "max_tokens")
    for key, want in (("metadata", dict), ("context_management", dict), ("cache_control", dict)):
        # accepted and ignored (README "Claude Code": why each is a no-op here)
        if body.get(key) is not None:
            _want(body[key], want, key, "an object")
    msgs: list[dict[str, Any]] = []
    if body.get("system") and (system := _system(body["system"])):
        msgs.append({"role": "system", "content": system})
    messages = _want(body.get("messages"), list, "messages", "a list of messages")
    if not messages:
        raise bad_request("messages: at least one message is required", "messages")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        _want(m, dict, where, "a message object")
        if m.get("role") not in ("user", "assistant", "system"):
            raise bad_request(
                f"{where}.role: must be user, assistant or system (got {json.dumps(m.get('role'))[:40]})",
                f"{where}.role",
            )
        if m["role"] == "system":
            _system_in_messages(messages, i)
        _message(m, where, msgs)
    chat: dict[str, Any] = {"model": body["model"], "messages": msgs, "max_tokens": max_tokens}
    for key, kind, what in (
        ("temperature", (int, float), "a number"),
        ("top_p", (int, float), "a number"),
        ("top_k", int, "an integer"),
        ("stream", bool, "true or false"),
    ):
        if body.get(key) is not None and not count_only:
            chat[key] = _want(body[key], kind, key, what)
    if chat.get("temperature") is not None and not 0 <= chat["temperature"] <= 1:
        raise bad_request("temperature: must be between 0 and 1", "temperature")
    if body.get("stop_sequences"):
        stops = _want(body["stop_sequences"], list, "stop_sequences", "a list of strings")
        for j, s in enumerate(stops):
            _want(s, str, f"stop_sequences[{j}]", "a string")
        chat["stop"] = stops
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"]) or None
    if body.get("tool_choice") is not None:
        _tool_choice(body["tool_choice"], chat)
        if not chat.get("tools") and chat["tool_choice"] == "none":
            del chat["tool_choice"]
    _thinking(body, chat)
    return chat
