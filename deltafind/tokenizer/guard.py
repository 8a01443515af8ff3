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
        added = [
            t
            for t in backend.get_added_tokens_decoder().values()
            if t.special and len(t.content) > 1
        ]
        # One-character specials cannot be broken by a mark; none of the formats we serve has one.
        self._tokens = {t.content: t for t in added}
        self._ids = {t.content: backend.token_to_id(t.content) for t in added}
        self._longest = max(map(len, self._tokens), default=0)
        self._prefixes = {c[:i] for c in self._tokens for i in range(1, len(c))}
        self._suffixes = {c[i:] for c in self._tokens for i in range(1, len(c))}
        groups: dict[str, list[str]] = {}
        for c in sorted(self._tokens, key=len, reverse=True):
            groups.setdefault(c[:2], []).append(c[2:])
        self._groups = [
            re.compile(re.escape(head) + "(?:" + "|".join(map(re.escape, rests)) + ")")
            for head, rests in groups.items()
        ]

    def _occurrences(self, text: str) -> list[tuple[int, str]]:
        """Leftmost-longest matches of each group of specials sharing two first characters: one regex per
        group starts with that literal, so a scan costs a fast search, not hundreds of alternatives a position."""
        found = []
        for pattern in self._groups:
            found += [(m.start(), m.group()) for m in pattern.finditer(text)]
        return found

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
        if not self._tokens:
            return text
        marks: set[int] = set()
        while found := self._occurrences(text):  # again until none is left: one may overlap another
            text = _insert(text, {at + 1 for at, _ in found})
        # An end that could complete a special with the template's text beside it (trimmed or not).
        for start, end in ((0, len(text)), _stripped(text)):
            core = text[start:end]
            if any(core[:n] in self._suffixes for n in range(1, min(len(core), self._longest) + 1)):
                marks.add(start)
            if any(
                core[-n:] in self._prefixes for n in range(1, min(len(core), self._longest) + 1)
            ):
                marks.add(end)
        return _insert(text, marks)

    def encode(self, rendered: str, plain: Callable[[str], list[int]]) -> list[int]:
        """Ids of a prompt rendered from escaped strings: special spellings left are the template's.

        Matched as tokenizers matches added tokens: leftmost, then longest, taking the whitespace
        beside a token whose lstrip/rstrip is set.
        """
        ids: list[int] = []
        last = 0
        for at, special in sorted(self._occurrences(rendered), key=lambda o: (o[0], -len(o[1]))):
            if at < last:
                continue  # inside a match already taken
            token, start, end = self._tokens[special], at, at + len(special)
            while token.lstrip and start > last and rendered[start - 1].isspace():
                start -= 1
            while token.rstrip and end < len(rendered) and rendered[end].isspace():
                end += 1
            ids += plain(rendered[last:start].replace(BREAK, ""))
            ids.append(self._ids[special])
            last = end
        ids += plain(rendered[last:].replace(BREAK, ""))
        return ids


def _insert(text: str, marks: set[int]) -> str:
    if not marks:
        return text
    out, last = [], 0
    for at in sorted(marks):
        out += [text[last:at], BREAK]
        last = at
    out.append(text[last:])
    return "".join(out)


def _stripped(text: str) -> tuple[int, int]:
    start = len(text) - len(text.lstrip())
    return start, max(start, len(text.rstrip()))
