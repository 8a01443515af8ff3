"""The OpenAI request bodies we accept, validated strictly.

Unknown fields, wrong types, out-of-range values and features we cannot honour
(tools, images, audio, logit_bias, ...) are a 400 naming the field — never
silently ignored. `parse_body` turns a JSON object (`load_json`) into a validated model.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from deltafind.server.errors import ApiError, bad_request

MAX_N = 8
MAX_STOPS = 4
MAX_SEED = 2**63 - 1

# Known OpenAI fields this server cannot honour: a clear "not supported", not "unknown".
UNSUPPORTED = {
    "functions": "function calling (use tools)",
    "function_call": "function calling",
    "audio": "audio output",
    "modalities": "output modalities",
    "prediction": "predicted outputs",
    "web_search_options": "web search",
    "service_tier": "service tiers",
    "suffix": "suffix (insertion)",
    "verbosity": "verbosity",
    "prompt_cache_key": "prompt cache keys",
    "safety_identifier": "safety identifiers",
}
# Defaults that SDKs (LangChain, LiteLLM, agent frameworks) send on every request: these values,
# and null for any UNSUPPORTED field, ask for nothing, so the field is dropped before validation.
NO_OP: dict[str, tuple[Any, ...]] = {
    "tools": ([],),
    "functions": ([],),
    "service_tier": ("auto", "default"),
    "modalities": (["text"],),
}
# Accepted only at their no-op value.
NEUTRAL = {
    "logit_bias": ({}, None),
    "store": (False, None),
    "echo": (False, None),
    "best_of": (1, None),
}
# Template variables the server sets itself (the request's messages and tools, K3's choice and format):
# a `chat_template_kwargs` key of that name would collide with them.
RESERVED_TEMPLATE_KWARGS = (
    "messages",
    "tools",
    "add_generation_prompt",
    "self",
    "tool_choice",
    "response_format",
    "thinking_effort",
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    refusal: str | None = None
    # Tool calling and reasoning (checked in detail by server/tools.py when the prompt is built).
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: Annotated[str, Field(max_length=256)] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None

    @field_validator("tool_calls")
    @classmethod
    def _calls_are_objects(cls, calls: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for j, c in enumerate(calls or []):
            fn = c.get("function")
            if not isinstance(fn, dict):
                raise ValueError(
                    f"item {j}: `function` must be an object with `name` and `arguments`"
                )
            if not isinstance(fn.get("name"), str):
                raise ValueError(f"item {j}: `function.name` must be a string")
            if not isinstance(fn.get("arguments", "{}"), str | dict):
                raise ValueError(f"item {j}: `function.arguments` must be a JSON string")
            if not isinstance(c.get("id", ""), str | None):
                raise ValueError(f"item {j}: `id` must be a string")
        return calls

    def text(self) -> str:
        if self.content is None:
            return ""
        return (
            self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        )


Stop = Annotated[str, Field(min_length=1, max_length=256)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class _Common(_Strict):
    model: Annotated[str, Field(min_length=1, max_length=256)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=1)] | None = (
        None  # not OpenAI's: vLLM's extension, and Anthropic's /v1/messages
    )
    n: Annotated[int, Field(ge=1, le=MAX_N)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: Stop | Annotated[list[Stop], Field(max_length=MAX_STOPS)] | None = None
    seed: Annotated[int, Field(ge=-MAX_SEED - 1, le=MAX_SEED)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    metadata: (
        Annotated[
            dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
            Field(max_length=16),
        ]
        | None
    ) = None
    # Accepted only at their no-op values (checked before validation), typed loosely here.
    logit_bias: dict[str, Any] | None = None
    store: bool | None = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _Common:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream: true")
        return self

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatRequest(_Common):
    messages: Annotated[list[Message], Field(min_length=1, max_length=4096)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=256)] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "max"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("chat_template_kwargs")
    @classmethod
    def _no_reserved_kwargs(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        bad = next((k for k in kwargs or {} if k in RESERVED_TEMPLATE_KWARGS), None)
        if bad is not None:
            raise ValueError(
                f"{bad!r} is set by the server from the request itself; remove the key"
            )
        return kwargs

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs: true")
        return self

    @property
    def token_limit(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )


TokenIds = Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]


class CompletionRequest(_Common):
    prompt: (
        Annotated[str, Field(max_length=4_000_000)]
        | TokenIds
        | Annotated[list[str], Field(min_length=1, max_length=MAX_N)]
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_N)]
    )
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool | None = None
    best_of: Annotated[int, Field(ge=1, le=1)] | None = None

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def load_json(raw: bytes) -> dict[str, Any]:
    """Bytes -> a JSON object, or a 400 saying what is wrong with them."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(
            f"the request body is not valid UTF-8 (byte {e.start})", None, "invalid_json"
        ) from None
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:
        raise bad_request(
            f"the request body is not valid JSON: {e}", None, "invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", None, "invalid_json")
    try:  # "\ud800" escapes decode to lone surrogates, which no tokenizer can encode
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(
            "the request body has an invalid \\u escape (a lone UTF-16 surrogate)",
            None,
            "invalid_json",
        ) from None
    except (ValueError, RecursionError):
        raise bad_request("the request body is nested too deeply", None, "invalid_json") from None
    return body


def _loc(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _drop_no_ops(body: dict[str, Any]) -> None:
    """Null asks for nothing, whatever the field (SDKs send their defaults as null); so do the NO_OP values,
    also on an endpoint that lacks the feature (`tools: []` on /v1/completions)."""
    for key in list(body):
        if body[key] is None or any(
            type(body[key]) is type(v) and body[key] == v for v in NO_OP.get(key, ())
        ):
            del body[key]


def _precheck(body: dict[str, Any], chat: bool) -> None:
    _drop_no_ops(body)
    for key, what in UNSUPPORTED.items():
        if key in body:
            raise bad_request(
                f"{key}: {what} is not supported by this server; remove the field",
                key,
                "unsupported_parameter",
            )
    for key, allowed in NEUTRAL.items():
        if key in body and body[key] not in allowed:
            raise bad_request(
                f"{key}: only {json.dumps(allowed[0])} is supported (got {json.dumps(body[key])[:80]})",
                key,
                "unsupported_parameter",
            )
    if not chat or not isinstance(body.get("messages"), list):
        return
    for i, m in enumerate(body["messages"]):
        if not isinstance(m, dict):
            continue
        if m.get("role") == "function":
            raise bad_request(
                f"messages[{i}].role: 'function' messages are not supported (use 'tool')",
                f"messages[{i}].role",
                "unsupported_parameter",
            )
        for key in ("function_call", "audio"):
            if m.get(key) is not None:
                raise bad_request(
                    f"messages[{i}].{key} is not supported by this server",
                    f"messages[{i}].{key}",
                    "unsupported_parameter",
                )
        if isinstance(m.get("content"), list):
            for j, part in enumerate(m["content"]):
                if isinstance(part, dict) and part.get("type") not in (None, "text"):
                    raise bad_request(
                        f"messages[{i}].content[{j}]: {part.get('type')!r} content is not supported (text only)",
                        f"messages[{i}].content[{j}].type",
                        "unsupported_content",
                    )


_BRANCH = re.compile(r"[\w-]*\[.*\]|constrained-\w+|function-\w+|str|int|float|bool|list|dict|none")


def _describe(err: dict[str, Any]) -> tuple[str, str | None]:
    # Drop the union branch tags pydantic adds ('list[TextPart]', 'constrained-str'); keep fields and indexes.
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and _BRANCH.fullmatch(p)))
    param = _loc(loc) or None
    kind = err["type"]
    if kind == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", param
    if kind == "missing":
        return f"{param}: required field is missing", param
    msg = str(err["msg"]).removeprefix("Value error, ")
    if param is None and ": " in msg:  # a model-level check names its field first
        return msg, msg.split(": ", 1)[0]
    return (f"{param}: {msg}" if param else msg), param


def parse_body(body: dict[str, Any], chat: bool) -> ChatRequest | CompletionRequest:
    _precheck(body, chat)
    model = ChatRequest if chat else CompletionRequest
    try:
        return model.model_validate(body)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        # A union field reports one error per branch: name the field once.
        # Prefer the branch whose type fit the input: its complaint is about the value.
        err = next((x for x in errors if not str(x["type"]).endswith("_type")), errors[0])
        message, param = _describe(err)
        raise ApiError(
            400,
            message,
            param,
            "unknown_parameter" if err["type"] == "extra_forbidden" else "invalid_value",
        ) from None
