"""Unforgeable prompt encoding: only a chat template's own markup becomes control tokens.

Every caller-supplied string (message content, names, tool descriptions and results,
template kwargs) is escaped before rendering: a break mark goes inside each special-token
spelling it holds and at an end that could join template text into one. The rendered text
is then split on the special spellings left (the template's) and the rest, break marks
removed, is encoded as plain text. Strings without special text render unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from tokenizers import Tokenizer as Backend

# A Unicode noncharacter (not for interchange): the break mark. Any in caller text becomes U+FFFD.
BREAK = "\ufdd0"


class SpecialGuard:
    """Escapes caller strings and encodes a rendered prompt for one vocabulary's special tokens."""

    def __init__(self, backend: Backend) -> None:
        added = [t for t in backend.get_added_tokens_decoder().values() if t.special and t.content]
        # One-character specials cannot be broken by a mark; none of the formats we serve has one.
        self._specials = sorted({t.content for t in added if len(t.content) > 1}, key=len, reverse=True)
        alternatives = "|".join(map(re.escape, self._specials))
        self._starts = re.compile(f"(?=(?:{alternatives}))") if self._specials else None
        self._longest = len(self._specials[0]) if self._specials else 0
        self._prefixes = {s[:i] for s in self._specials for i in range(1, len(s))}
        self._suffixes = {s[i:] for s in self._specials for i in range(1, len(s))}
        # tokenizers' lstrip/rstrip: the token takes the whitespace beside it.
        parts, self._group_ids = [], {}
        for t in sorted(added, key=lambda t: len(t.content), reverse=True):
            if len(t.content) > 1:
                lead, trail = (r"\s*" if t.lstrip else ""), (r"\s*" if t.rstrip else "")
                self._group_ids[f"t{len(parts)}"] = backend.token_to_id(t.content)
                parts.append(f"{lead}(?P<t{len(parts)}>{re.escape(t.content)}){trail}")
        self._split = re.compile("|".join(parts)) if parts else None

    def escape(self, value: Any) -> Any:
        """`value` with every string in it (dict keys too) escaped; other values as they are."""
        if isinstance(value, str):
            return self._escape_str(value)
        if isinstance(value, dict):
            return {self.escape(k): self.escape(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self.escape(v) for v in value)
        return value

    def _escape_str(self, text: str) -> str:
        text = text.replace(BREAK, "\ufffd")
        if self._starts is None:
            return text
        marks = {m.start() + 1 for m in self._starts.finditer(text)}  # inside every occurrence, overlapping too
        # An end that could complete a special with the template's text beside it (trimmed or not).
        for start, end in ((0, len(text)), _stripped(text)):
            core = text[start:end]
            if any(core[:n] in self._suffixes for n in range(1, min(len(core), self._longest) + 1)):
                marks.add(start)
            if any(core[-n:] in self._prefixes for n in range(1, min(len(core), self._longest) + 1)):
                marks.add(end)
        if not marks:
            return text
        out, last = [], 0
        for at in sorted(marks):
            out += [text[last:at], BREAK]
            last = at
        out.append(text[last:])
        return "".join(out)

    def encode(self, rendered: str, plain: Callable[[str], list[int]]) -> list[int]:
        """Ids of a prompt rendered from escaped strings: special spellings left are the template's."""
        ids: list[int] = []
        last = 0
        for m in self._split.finditer(rendered) if self._split else ():
            ids += plain(rendered[last : m.start()].replace(BREAK, ""))
            ids.append(self._group_ids[m.lastgroup])
            last = m.end()
        ids += plain(rendered[last:].replace(BREAK, ""))
        return ids


def _stripped(text: str) -> tuple[int, int]:
    start = len(text) - len(text.lstrip())
    return start, max(start, len(text.rstrip()))
