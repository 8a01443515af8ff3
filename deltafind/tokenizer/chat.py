"""Chat templates: jinja2 programs from the model's files, rendered as transformers does.

Owns the sandboxed environment (trim/lstrip blocks, loopcontrols, a tojson that
keeps non-ASCII, raise_exception, strftime_now, the {% generation %} tag) and
the mapping of template failures to deltafind errors. Knows nothing of ids.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from deltafind.errors import DeltafindError, RequestError


class _TemplateRaised(Exception):
    """`raise_exception(...)` from inside a template: the request broke its rules."""


class _GenerationTag(Extension):
    # Training templates mark assistant spans with {% generation %}; rendering keeps the body.
    tags = {"generation"}  # noqa: RUF012 (jinja's Extension API)

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body", []), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    # As transformers: namespaces refuse underscore names, a route to CPython internals.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore attribute {name!r}"
            )


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson HTML-escapes and forces ASCII; templates expect plain json.dumps.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(message: Any) -> Any:
    # Clients send reasoning under several names; templates read `reasoning_content`
    # (gpt-oss reads `thinking`). transformers fills both the same way.
    if not isinstance(message, dict):
        return message
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


class ChatTemplate:
    """A compiled chat template and the file it came from (named in every error)."""

    def __init__(self, source: str, origin: str) -> None:
        self.origin = origin
        try:
            self._template = _make_env().from_string(source)
        except jinja2.TemplateError as e:
            raise DeltafindError(f"chat template in {origin} does not compile: {e}") from None

    def render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render `messages`; `kwargs` (tools, documents, bos_token, ...) become template variables."""
        context = {"tools": None, "documents": None, **kwargs}
        try:
            return self._template.render(
                messages=[_alias_reasoning(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                **context,
            )
        except _TemplateRaised as e:
            raise RequestError(
                f"the chat template ({self.origin}) rejected the messages: {e}", "messages"
            ) from None
        except (
            jinja2.TemplateError,
            TypeError,
            ValueError,
            KeyError,
            AttributeError,
            IndexError,
        ) as e:
            raise DeltafindError(
                f"chat template in {self.origin} failed: {type(e).__name__}: {e}"
            ) from None
