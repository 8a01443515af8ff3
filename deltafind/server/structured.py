"""Structured output enforced by the decoder: JSON schemas and Lark grammars -> engine Constraints.

Owns the llguidance-backed `GrammarConstraint` (the engine's `Constraint` contract,
engine/constraint.py; its masks are built on worker threads, overlapped with the
forward), the per-tokenizer llguidance vocabulary (built once, at model load, ~1 s
for 49k ids) and compiling `response_format` schemas. It lives in `server/`
because only the API turns requests into grammars; the engine sees the mask.
A grammar is compiled, checked and started on the request thread under llguidance's
own limits (`LIMITS`), so a schema it cannot compile or start is a 400 naming the field
before anything is submitted; one that hits a limit later ends its request with a 400.
"""

from __future__ import annotations

import json
import os
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import llguidance as llg
import numpy as np
import torch

from deltafind.engine.constraint import ConstraintError, ConstraintFactory
from deltafind.log import get_logger
from deltafind.server.errors import bad_request

log = get_logger(__name__)

_VOCABS: weakref.WeakKeyDictionary[Any, llg.LLTokenizer] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
# Grammar work off the engine thread (matchers, masks): a few threads, as llguidance runs them without the GIL.
_MASKS = ThreadPoolExecutor(
    max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="deltafind-mask"
)
# llguidance's own bounds on a grammar's size, lexer fuel (regex work, so time and memory per compile and per
# token) and parser items; errors without the parser-state dump, which is noise to a client (README, structured output).
LIMITS = llg.LLParserLimits(verbose_errors=False)
# The JSON shape every json_object answer and free-form tool call obeys.
ANY_OBJECT: dict[str, Any] = {"type": "object"}
# JSON as chat templates print it (`tojson` is json.dumps), so a sent-back answer renders as generated.
JSON_STYLE = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


def vocabulary(tokenizer: Any) -> llg.LLTokenizer:
    """llguidance's view of `tokenizer` (token bytes, specials, EOS), built once per tokenizer.

    A caller that finds it being built (`prepare_vocabulary`) waits for it under the lock.
    """
    with _LOCK:
        lt = _VOCABS.get(tokenizer)
        if lt is None:
            t0 = time.perf_counter()
            lt = llg.LLTokenizer(
                tokenizer.backend_json(),
                n_vocab=tokenizer.vocab_size,
                eos_token=list(tokenizer.eos_token_ids),
            )
            _VOCABS[tokenizer] = lt
            log.info(
                "grammar_vocabulary_built",
                tokens=tokenizer.vocab_size,
                seconds=round(time.perf_counter() - t0, 2),
                thread=threading.current_thread().name,
            )
        return lt


def prepare_vocabulary(tokenizer: Any) -> None:
    """Build `tokenizer`'s grammar vocabulary on a background thread (at model load), so the first
    constrained request does not pay for it (~1 s for 49k ids, 5-10 s for K3's 160k); it waits if early.

    llguidance holds the GIL while it builds: started during loading, it overlaps the warm-up's I/O.
    """

    def build() -> None:
        try:
            vocabulary(tokenizer)
        except Exception as e:  # a request builds it again and reports the failure as its own
            log.warning("grammar_vocabulary_failed", error=f"{type(e).__name__}: {e}")

    threading.Thread(target=build, name="deltafind-grammar-vocab", daemon=True).start()


class GrammarConstraint:
    """One sequence's grammar state (llguidance `LLMatcher`): the engine's `Constraint`.

    The matcher and each next mask are built on a worker thread (llguidance drops the GIL
    there): the first while the prompt prefills, the next as soon as a token is consumed,
    so it overlaps the next forward pass and `allowed` on the engine thread only waits
    for what is left. The matcher is used by one thread at a time: every call settles the
    pending job first.
    """

    def __init__(self, template: llg.LLMatcher, vocab_size: int, field: str) -> None:
        self._n, self._field = vocab_size, field
        self._m: llg.LLMatcher | None = None
        self._count = 0  # tokens consumed, for the error that names where the grammar gave up
        self._stopped = False  # read without touching the matcher, which a job may be using
        self._job: Future[torch.Tensor] | None = _MASKS.submit(self._start, template)

    def _start(self, template: llg.LLMatcher) -> torch.Tensor:
        self._m = (
            template.deep_copy()
        )  # the compiled grammar and lexer are shared, the parse state is this sequence's
        return self._compute()

    def _compute(self) -> torch.Tensor:
        assert self._m is not None
        bits = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)
        self._check()
        return torch.from_numpy(
            np.unpackbits(bits, count=self._n, bitorder="little").view(np.bool_)
        )

    def _check(self) -> None:
        """Raise ConstraintError when the matcher gave up (a limit hit on the way; it then allows only EOS)."""
        assert self._m is not None
        if self._m.is_error():
            raise ConstraintError(
                f"{self._field}: the output constraint gave up after {self._count} tokens: "
                f"{explain(self._m.get_error())}",
                self._field,
            )

    def _settle(self) -> torch.Tensor | None:
        """The pending job's mask (None when none is pending); its failure is raised here, on the caller's thread."""
        return None if self._job is None else self._job.result()

    def allowed(self) -> torch.Tensor | None:
        mask = self._settle()
        if mask is None:
            mask = self._compute()
            self._job = _done(mask)
        return mask

    def advance(self, token: int) -> bool:
        mask = self._settle()
        m = self._m
        assert m is not None
        if m.is_stopped() or m.is_error():
            return False
        known = mask is not None and 0 <= token < len(mask)
        # A refused token would break the matcher for good: a sampled token is checked against its mask,
        # anything else (a speculative draft) by the matcher first.
        if (known and not mask[token]) or (not known and m.validate_tokens([token]) != 1):
            return False
        self._job = None
        if not m.consume_token(token):
            self._check()  # an allowed token the grammar could not take: it hit a limit
            return False
        self._count += 1
        self._stopped = m.is_stopped()
        if not self._stopped:
            self._job = _MASKS.submit(
                self._compute
            )  # the next mask, while the engine runs the next forward
        return True

    def rollback(self, n: int) -> None:
        if n:
            self._settle()
            self._job = None
            assert self._m is not None
            self._m.rollback(n)
            self._count -= n
            self._stopped = self._m.is_stopped()

    @property
    def done(self) -> bool:
        return self._stopped


def _done(value: torch.Tensor) -> Future[torch.Tensor]:
    f: Future[torch.Tensor] = Future()
    f.set_result(value)
    return f


class TriggeredConstraint:
    """Free text until the output reaches `marker`, then `grammar` (which starts with the marker) from there:
    a tool call under tool_choice "auto" has its arguments enforced once the model starts it."""

    def __init__(self, make: ConstraintFactory, decode: Any, marker: str) -> None:
        self._make, self._decode, self._marker = make, decode, marker
        self._tokens: list[int] = []
        self._start = -1  # index of the first token the grammar consumed (-1: not triggered)
        self._inner: Any = None  # a GrammarConstraint once triggered
        self._lookback = (
            len(marker.encode()) + 1
        )  # tokens searched back for the marker's first one (bytes at worst)

    def allowed(self) -> torch.Tensor | None:
        return None if self._inner is None else self._inner.allowed()

    def advance(self, token: int) -> bool:
        if self._inner is not None:
            if not self._inner.advance(token):
                return False
            self._tokens.append(token)
            return True
        self._tokens.append(token)
        if self._marker in self._decode(self._tokens[-self._lookback :]):
            for k in range(1, min(len(self._tokens), self._lookback) + 1):
                if self._decode(self._tokens[-k:]).startswith(self._marker):
                    inner = self._make()
                    if all(inner.advance(t) for t in self._tokens[-k:]):
                        self._inner, self._start = inner, len(self._tokens) - k
                    break  # a marker glued to text before it in one token stays free text
        return True

    def rollback(self, n: int) -> None:
        for _ in range(n):
            self._tokens.pop()
            if self._inner is not None:
                if len(self._tokens) <= self._start:
                    self._inner, self._start = None, -1
                else:
                    self._inner.rollback(1)

    @property
    def done(self) -> bool:
        return self._inner is not None and self._inner.done


class Grammar:
    """A compiled grammar for one tokenizer; `factory()` makes a fresh constraint per sequence.

    Admission starts it once: a grammar that llguidance refuses, that admits no value at all (`{"$ref": "#"}`)
    or that breaks a limit on its forced opening (`"pattern": "^a{1000000}$"`) is a 400 naming `field` here,
    not a failure mid-output. Every sequence copies the started matcher instead of compiling again.
    """

    def __init__(self, tokenizer: Any, grammar: str, field: str) -> None:
        self.vocab = vocabulary(tokenizer)
        self.vocab_size = tokenizer.vocab_size
        self.field = field
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(
            grammar, self.vocab, limits=LIMITS
        )
        if is_error:
            raise bad_request(
                f"{field}: the schema cannot be enforced: {explain(messages[0])}",
                field,
                "invalid_schema",
            )
        self._matcher = llg.LLMatcher(self.vocab, grammar, log_level=0, limits=LIMITS)
        probe = self._matcher.deep_copy()
        probe.compute_bitmask()
        if not probe.is_error():  # the text every answer starts with, run through the lexer now
            probe.consume_tokens(probe.compute_ff_tokens())
        if self._matcher.is_error() or probe.is_error():
            error = self._matcher.get_error() or probe.get_error()
            raise bad_request(
                f"{field}: the schema cannot be enforced: {explain(error)}", field, "invalid_schema"
            )

    def factory(self) -> ConstraintFactory:
        return lambda: GrammarConstraint(self._matcher, self.vocab_size, self.field)

    def triggered_factory(self, tokenizer: Any, marker: str) -> ConstraintFactory:
        """Constraints that let text run free until `marker`, then enforce this grammar."""
        return lambda: TriggeredConstraint(self.factory(), tokenizer.decode, marker)


def explain(error: str) -> str:
    """llguidance's error, first line, with what it means for the schema and the fix."""
    line = (error.strip().splitlines() or ["unknown error"])[0][:300]
    if "NoExtension" in line:
        return (
            f"no value satisfies it ({line}): a `$ref` that only leads back to itself, or a cycle of `$ref`s "
            "with no way out, never reaches a value; give the recursion a base case"
        )
    return (
        f"{line}: it is past the grammar engine's limits (regex work, lexer states, grammar size); use smaller "
        "repetition counts (`{n}`, `minLength`/`maxLength`), fewer `enum`/`anyOf` alternatives or a smaller schema"
    )


def _style(schema: dict[str, Any]) -> dict[str, Any]:
    """JSON_STYLE, lenient where `lenient_schema` made it so (only that option of a schema's x-guidance is read)."""
    own = schema.get("x-guidance")
    return (
        {**JSON_STYLE, "lenient": True}
        if isinstance(own, dict) and own.get("lenient") is True
        else JSON_STYLE
    )


def json_schema_grammar(schema: dict[str, Any] | bool, field: str) -> str:
    """llguidance grammar text for one JSON schema (a 400 naming `field` when it is not usable)."""
    if not isinstance(schema, dict | bool):
        raise bad_request(
            f"{field}: a JSON schema must be an object (got {type(schema).__name__})",
            field,
            "invalid_schema",
        )
    try:
        return llg.LLMatcher.grammar_from_json_schema(
            schema if isinstance(schema, dict) else {} if schema else {"not": {}},
            overrides=_style(schema) if isinstance(schema, dict) else JSON_STYLE,
        )
    except (ValueError, TypeError) as e:
        raise bad_request(
            f"{field}: the schema cannot be compiled: {e}", field, "invalid_schema"
        ) from None


def lenient_schema(schema: dict[str, Any], field: str) -> dict[str, Any]:
    """`schema`, or, where llguidance does not implement one of its keywords (`propertyNames`, some `format`s,
    ...), `schema` marked lenient: those keywords are then not enforced, the rest is (README "Tool schemas").

    A schema that fails even so (not a valid JSON schema) is a 400 naming `field`.
    """
    is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(
        json_schema_grammar(schema, field), None, limits=LIMITS
    )
    if not is_error:
        return schema
    lenient = {**schema, "x-guidance": {**JSON_STYLE, "lenient": True}}
    still, messages2 = llg.LLMatcher.validate_grammar_with_warnings(
        json_schema_grammar(lenient, field), None, limits=LIMITS
    )
    if still:
        raise bad_request(
            f"{field}: the schema cannot be enforced: {messages2[0] if messages2 else messages[0]}",
            field,
            "invalid_schema",
        )
    log.info("schema_lenient", field=field, unsupported=messages[0][:200] if messages else "")
    return lenient


def lark_json(schema: dict[str, Any]) -> str:
    """A Lark rule body that embeds a JSON schema (`%json {...}`)."""
    return "%json " + json.dumps({**schema, "x-guidance": _style(schema)}, ensure_ascii=False)


def lark_literal(text: str) -> str:
    """A Lark string literal for `text` (JSON escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def response_format_schema(response_format: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """(schema to enforce, or None for plain text; the field it came from) of an OpenAI `response_format`."""
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None, "response_format"
    if kind == "json_object":
        return ANY_OBJECT, "response_format"
    if kind == "json_schema":
        js = response_format.get("json_schema")
        if not isinstance(js, dict) or ("schema" not in js and "name" not in js):
            raise bad_request(
                "response_format.json_schema: required object with `name` and `schema`",
                "response_format.json_schema",
                "invalid_value",
            )
        schema = js.get("schema", {})
        if not isinstance(schema, dict):
            raise bad_request(
                "response_format.json_schema.schema: must be a JSON object",
                "response_format.json_schema.schema",
                "invalid_schema",
            )
        return schema, "response_format.json_schema.schema"
    raise bad_request(
        f"response_format.type: {kind!r} is not one of text, json_object, json_schema",
        "response_format.type",
        "invalid_value",
    )
