"""Chat templates: jinja2 programs from the model's files, rendered as transformers does.

Owns the sandboxed environment (trim/lstrip blocks, loopcontrols, a tojson that
keeps non-ASCII, raise_exception, strftime_now, the {% generation %} tag) and
the mapping of template failures to deltafind errors. Knows nothing of ids.
Templates come from downloaded models, so rendering is bounded: in time
(RENDER_TIMEOUT_S), in output and in the size of any string or list it builds
(MAX_RENDER_CHARS). A template that fails is the store's fault (StoreError); one
that calls raise_exception refused the request (RequestError).
"""

from __future__ import annotations

import ctypes
import json
import operator
import threading
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from deltafind.errors import DeltafindError, RequestError, StoreError

RENDER_TIMEOUT_S = 5.0  # real templates render in milliseconds
MAX_RENDER_CHARS = 32 << 20  # a prompt far past any context window


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


class _TooLarge(Exception):
    """A template built a string or list over MAX_RENDER_CHARS."""


class _Timeout(BaseException):
    """Raised inside the rendering thread when RENDER_TIMEOUT_S passes (BaseException: templates cannot catch it)."""


_BINOPS = {"+": operator.add, "*": operator.mul, "**": operator.pow}


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    # '*', '**' and '+' are checked before they run ('a' * 10**9 must never be built).
    intercepted_binops = frozenset(_BINOPS)

    def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
        if op in ("*", "**"):
            if op == "**" and isinstance(left, int) and isinstance(right, int) and abs(right) * max(abs(left), 2).bit_length() > 4096:
                raise _TooLarge(f"{left} ** {right}")
            if op == "*" and isinstance(right, int) and isinstance(left, (str, list, tuple)):
                left, right = right, left
            if op == "*" and isinstance(left, int) and isinstance(right, (str, list, tuple)) and left * len(right) > MAX_RENDER_CHARS:
                raise _TooLarge(f"a sequence of {len(right)} repeated {left} times")
        elif op == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)) \
                and len(left) + len(right) > MAX_RENDER_CHARS:
            raise _TooLarge(f"a sequence of {len(left) + len(right)}")
        return _BINOPS[op](left, right)


def _make_env() -> ImmutableSandboxedEnvironment:
    env = _BoundedEnvironment(
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
        where, fix = f"the chat template in {self.origin}", "the store's template is at fault, not the request: fix or replace it"
        try:
            chunks = self._template.generate(
                messages=[_alias_reasoning(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                **context,
            )
            return _bounded_join(chunks)
        except _TemplateRaised as e:
            raise RequestError(
                f"the chat template ({self.origin}) rejected the messages: {e}", "messages"
            ) from None
        except _Timeout:
            raise StoreError(f"{where} ran over {RENDER_TIMEOUT_S:g} s and was stopped; {fix}") from None
        except (_TooLarge, MemoryError) as e:
            raise StoreError(f"{where} built more than {MAX_RENDER_CHARS} characters ({e}) and was stopped; {fix}") from None
        except Exception as e:  # any failure inside the template program
            raise StoreError(f"{where} failed: {type(e).__name__}: {e}; {fix}") from None


def _bounded_join(chunks: Any) -> str:
    """Join the rendered chunks, stopping at MAX_RENDER_CHARS or after RENDER_TIMEOUT_S."""
    with _Deadline(RENDER_TIMEOUT_S):
        out: list[str] = []
        size = 0
        for chunk in chunks:
            size += len(chunk)
            if size > MAX_RENDER_CHARS:
                raise _TooLarge("its output")
            out.append(chunk)
        return "".join(out)


class _Deadline:
    """Raise _Timeout in this thread after `seconds`, even inside a tight template loop.

    A timer thread delivers the exception with PyThreadState_SetAsyncExc, which
    lands at the next bytecode; leaving the block in time withdraws it under a lock.
    """

    def __init__(self, seconds: float) -> None:
        self.seconds, self.tid = seconds, threading.get_ident()
        self.lock = threading.Lock()
        self.done = self.fired = False
        self.timer = threading.Timer(seconds, self._fire)
        self.timer.daemon = True

    def _fire(self) -> None:
        with self.lock:
            if not self.done:
                self.fired = True
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.tid), ctypes.py_object(_Timeout))

    def __enter__(self) -> _Deadline:
        self.timer.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.timer.cancel()
        with self.lock:
            self.done = True
            if self.fired:  # withdraw an exception that has not landed yet
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.tid), None)
