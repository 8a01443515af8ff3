"""The chat-template renderer's own process: jinja2 in the sandbox transformers uses.

Run as a script (`python -I template_worker.py`) by `chat.py`, it renders one request per
line of JSON on stdin and answers one line on stdout. Its address space is capped
(MEMORY_BYTES), so a template that builds a huge string, by any operator, filter or str
method, or while jinja folds constants at compile time, fails here, not in the daemon.
Imports nothing of deltafind: the daemon's parent process maps the error kinds it sends.
"""

from __future__ import annotations

import functools
import json
import operator
import resource
import sys
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_RENDER_CHARS = 32 << 20  # a prompt far past any context window
# Room for an output of MAX_RENDER_CHARS (4 bytes a character) and its JSON several times over.
MEMORY_BYTES = 1 << 30


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


_BINOPS = {"+": operator.add, "*": operator.mul, "**": operator.pow}


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    # '*', '**' and '+' are checked before they run ('a' * 10**9 must never be built).
    intercepted_binops = frozenset(_BINOPS)

    def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
        if op in ("*", "**"):
            if (
                op == "**"
                and isinstance(left, int)
                and isinstance(right, int)
                and abs(right) * max(abs(left), 2).bit_length() > 4096
            ):
                raise _TooLarge(f"{left} ** {right}")
            if op == "*" and isinstance(right, int) and isinstance(left, (str, list, tuple)):
                left, right = right, left
            if (
                op == "*"
                and isinstance(left, int)
                and isinstance(right, (str, list, tuple))
                and left * len(right) > MAX_RENDER_CHARS
            ):
                raise _TooLarge(f"a sequence of {len(right)} repeated {left} times")
        elif (
            op == "+"
            and isinstance(left, (str, list, tuple))
            and isinstance(right, (str, list, tuple))
            and len(left) + len(right) > MAX_RENDER_CHARS
        ):
            raise _TooLarge(f"a sequence of {len(left) + len(right)}")
        return _BINOPS[op](left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        # str methods (center, ljust, replace, format, join, ...) build in C, past the checks above:
        # their result is measured before the template can keep or grow it.
        return _measured(super().call(__context, __obj, *args, **kwargs))


def _measured(value: Any) -> Any:
    if isinstance(value, (str, list, tuple)) and len(value) > MAX_RENDER_CHARS:
        raise _TooLarge(f"a value of {len(value)}")
    return value


def _measuring(f: Any) -> Any:
    @functools.wraps(f)  # keeps jinja's pass_context / pass_environment mark (`jinja_pass_arg`)
    def checked(*args: Any, **kwargs: Any) -> Any:
        return _measured(f(*args, **kwargs))

    return checked


class _RuntimeOutput(CodeGenerator):
    # jinja evaluates constant output expressions while compiling even with the optimizer off;
    # only literal template text may be folded, the rest runs under the checks.
    def _output_child_to_const(self, node: nodes.Expr, frame: Any, finalize: Any) -> str:
        if not isinstance(node, nodes.TemplateData):
            raise nodes.Impossible()
        return super()._output_child_to_const(node, frame, finalize)


def _make_env() -> ImmutableSandboxedEnvironment:
    env = _BoundedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, loopcontrols],
        optimized=False,  # no constant folding: every filter runs while rendering, under the size checks
    )
    env.code_generator_class = _RuntimeOutput
    env.filters["tojson"] = _tojson
    env.filters = {name: _measuring(f) for name, f in env.filters.items()}
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


def _bounded_join(chunks: Any) -> str:
    out: list[str] = []
    size = 0
    for chunk in chunks:
        size += len(chunk)
        if size > MAX_RENDER_CHARS:
            raise _TooLarge("its output")
        out.append(chunk)
    return "".join(out)


def _answer(request: dict[str, Any], compiled: dict[str, Any]) -> dict[str, Any]:
    source = request["source"]
    if source not in compiled:
        try:
            compiled[source] = _make_env().from_string(source)
        except jinja2.TemplateError as e:
            return {"error": "compile", "message": str(e)}
    if "messages" not in request:  # a compile check
        return {"text": ""}
    context = {"tools": None, "documents": None, **request["kwargs"]}
    try:
        chunks = compiled[source].generate(
            messages=[_alias_reasoning(m) for m in request["messages"]],
            add_generation_prompt=request["add_generation_prompt"],
            **context,
        )
        return {"text": _bounded_join(chunks)}
    except _TemplateRaised as e:
        return {"error": "raised", "message": str(e)}
    except _TooLarge as e:
        return {"error": "too_large", "message": str(e)}
    except MemoryError:
        raise
    except Exception as e:  # any failure inside the template program
        return {"error": "failed", "message": f"{type(e).__name__}: {e}"}


def main() -> None:
    """Answer requests until stdin closes; exit after running out of memory (the heap may be torn)."""
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))
    compiled: dict[str, Any] = {}
    for line in sys.stdin.buffer:
        try:
            answer = _answer(json.loads(line), compiled)
        except MemoryError:
            compiled.clear()
            answer = {"error": "memory", "message": f"over {MEMORY_BYTES >> 20} MiB"}
        # UTF-8 (lone surrogates kept) rather than ASCII escapes: a third of the bytes for non-Latin text
        sys.stdout.buffer.write(
            json.dumps(answer, ensure_ascii=False).encode("utf-8", "surrogatepass") + b"\n"
        )
        sys.stdout.flush()
        if answer.get("error") == "memory":
            return


if __name__ == "__main__":
    main()
