"""A chat answer's text, split as it streams: reasoning, content and tool calls.

`OutputParser` takes the raw generated text (special tokens kept) piece by piece
and returns `Delta`s: reasoning text (`<think>` ... `</think>`, K3's think
channel), content text, and tool calls in the family's markup (server/formats)
as a call start (index, id, name) then argument fragments as they are generated.
Text that might be the start of a marker is held back until it is not, so no
markup ever reaches `content`. Knows nothing of the engine or of HTTP.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from deltafind.server.formats.template import ChatFormat
from deltafind.server.tools import ToolSpec
from deltafind.tokenizer.stream import held_len


@dataclass(frozen=True)
class Delta:
    kind: str  # reasoning | content | call | args
    text: str = ""
    index: int = 0
    call_id: str = ""


@dataclass
class ToolCall:
    index: int
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)
    mode: str | None = None  # json | elements (ChatFormat.begin_args)
    closed: bool = False  # the arguments object is complete

    def openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": "".join(self.arguments)},
        }


def _earliest(buf: str, markers: list[str]) -> tuple[int, str | None]:
    hits = [(buf.find(m), m) for m in markers if m and m in buf]
    return min(hits, key=lambda h: h[0]) if hits else (-1, None)


class _JsonScan:
    """Finds where one JSON object ends in streamed text (strings and escapes aware)."""

    def __init__(self) -> None:
        self.depth, self.in_str, self.esc, self.closed = 0, False, False, False

    def feed(self, text: str) -> int:
        for i, ch in enumerate(text):
            if self.in_str:
                self.esc, self.in_str = (False, True) if self.esc else (ch == "\\", ch != '"')
            elif ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.closed = True
                    return i + 1
        return len(text)


class OutputParser:
    """Split one choice's streamed text; `feed` per piece, `finish` once at the end."""

    def __init__(
        self,
        fmt: ChatFormat | None = None,
        think: tuple[str, str] | None = None,
        in_think: bool = False,
        strip: tuple[str, ...] = (),
        tools: Iterable[ToolSpec] = (),
    ) -> None:
        self.fmt, self.think, self.strip, self.tools = (
            fmt,
            think,
            list(strip),
            {t.name: t for t in tools},
        )
        self.r_state = "in" if think and in_think else ("maybe" if think else "out")
        self.rbuf = self.cbuf = ""
        self.mode = "content"
        self.calls: list[ToolCall] = []
        self.cur: ToolCall | None = None
        self.scan = _JsonScan()
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self._lstrip = False  # drop the blank lines a model writes after its thought
        self._any_content = False

    # -- public --------------------------------------------------------------

    def feed(self, text: str, final: bool = False) -> list[Delta]:
        out: list[Delta] = []
        self._reason(text, out, final)
        return out

    def finish(self) -> list[Delta]:
        return self.feed("", final=True)

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [c for c in self.calls if c.closed]

    # -- reasoning -----------------------------------------------------------

    def _reason(self, text: str, out: list[Delta], final: bool) -> None:
        self.rbuf += text
        if self.r_state == "maybe":
            s = self.rbuf.lstrip()
            open_ = self.think[0]  # type: ignore[index]
            if s.startswith(open_):
                self.r_state, self.rbuf = "in", s[len(open_) :]
            elif (s and not open_.startswith(s)) or final:
                self.r_state = "out"
            else:
                return
        if self.r_state == "in":
            close = self.think[1]  # type: ignore[index]
            idx = self.rbuf.find(close)
            if idx < 0:
                keep = 0 if final else held_len(self.rbuf, [close])
                self._emit(out, "reasoning", self.rbuf[: len(self.rbuf) - keep])
                self.rbuf = self.rbuf[len(self.rbuf) - keep :]
                return
            self._emit(out, "reasoning", self.rbuf[:idx])
            self.rbuf, self.r_state, self._lstrip = self.rbuf[idx + len(close) :], "out", True
        # past the thought: the rest is content and calls
        self.cbuf, self.rbuf = self.cbuf + self.rbuf, ""
        while self._step(out, final):
            pass

    # -- content and calls -----------------------------------------------------

    def _emit(
        self, out: list[Delta], kind: str, text: str, index: int = 0, call_id: str = ""
    ) -> None:
        if kind == "content":
            if self._lstrip:
                text = text.lstrip()
                self._lstrip = not text
            if text:
                self._any_content = self._any_content or bool(text.strip())
                self.content.append(text)
        elif kind == "reasoning" and text:
            self.reasoning.append(text)
        if text or kind == "call":
            out.append(Delta(kind, text, index, call_id))

    def _step(self, out: list[Delta], final: bool) -> bool:
        fmt = self.fmt
        if self.mode == "calls":
            return self._calls(out, final)
        # the call is the whole answer
        if fmt is not None and fmt.leads and not self._any_content and not self.calls:
            s = self.cbuf.lstrip()
            if not s and not final:
                return False
            if s.startswith(fmt.leads) or (
                s and not final and any(x.startswith(s) for x in fmt.leads)
            ):
                self.mode, self.cbuf = "calls", s
                return True
        starts = [fmt.start] if fmt is not None and fmt.start else []
        idx, marker = _earliest(self.cbuf, self.strip + starts)
        if marker is None:
            keep = 0 if final else held_len(self.cbuf, self.strip + starts)
            self._emit(out, "content", self.cbuf[: len(self.cbuf) - keep])
            self.cbuf = self.cbuf[len(self.cbuf) - keep :]
            return False
        self._emit(out, "content", self.cbuf[:idx])
        if marker in self.strip:
            self.cbuf = self.cbuf[idx + len(marker) :]
        else:
            self.mode = "calls"
            self.cbuf = self.cbuf[
                idx + (len(marker) if fmt and marker == fmt.section_open else 0) :
            ]
        return True

    def _calls(self, out: list[Delta], final: bool) -> bool:
        fmt = self.fmt
        assert fmt is not None
        if self.cur is None:
            s = self.cbuf.lstrip()
            if fmt.section_close and s.startswith(fmt.section_close):
                self.cbuf, self.mode = s[len(fmt.section_close) :], "content"
                return True
            if s.startswith(fmt.openers):
                m = fmt.header.match(s)
                if m is None:
                    if final:
                        self._fallback(s, out)
                        self.cbuf = ""
                    return False
                self.cur = ToolCall(
                    len(self.calls), "call_" + uuid.uuid4().hex[:24], m.group("name").strip()
                )
                self.calls.append(self.cur)
                self.scan = _JsonScan()
                self.cbuf = s[m.end() :]
                self._emit(out, "call", self.cur.name, self.cur.index, self.cur.id)
                return True
            if not s or (
                not final and any(x.startswith(s) for x in (*fmt.openers, fmt.section_close or ""))
            ):
                return False
            if fmt.section_open is None:  # text after standalone calls is content again
                self.mode, self.cbuf = "content", s
                return True
            nxt = min(
                (
                    i
                    for i in (s.find(fmt.call_open or "\0"), s.find(fmt.section_close or "\0"))
                    if i > 0
                ),
                default=-1,
            )
            self.cbuf = s[nxt:] if nxt > 0 else ""  # junk between calls inside a section
            return nxt > 0
        call = self.cur
        if call.mode is None:
            call.mode, self.cbuf = fmt.begin_args(self.cbuf, final)
            if call.mode is None:
                return False
        if call.mode == "elements":
            idx = self.cbuf.find(fmt.call_close)
            if idx < 0:
                return False
            args = fmt.elements(self.cbuf[:idx], self.tools.get(call.name))
            self._emit(out, "args", json.dumps(args, ensure_ascii=False), call.index)
            call.arguments.append(json.dumps(args, ensure_ascii=False))
            call.closed, self.cur, self.cbuf = True, None, self.cbuf[idx + len(fmt.call_close) :]
            return True
        if not call.closed:
            n = self.scan.feed(self.cbuf)
            piece, self.cbuf = self.cbuf[:n], self.cbuf[n:]
            if piece:
                call.arguments.append(piece)
                self._emit(out, "args", piece, call.index)
            call.closed = self.scan.closed
            if not call.closed:
                return False
        idx = self.cbuf.find(fmt.call_close)
        if idx < 0:
            if final:
                self.cur, self.cbuf = None, ""
            return False
        self.cur, self.cbuf = None, self.cbuf[idx + len(fmt.call_close) :]
        return True

    def _fallback(self, block: str, out: list[Delta]) -> None:
        # A call whose keys came in another order ({"arguments": ..., "name": ...}): parse it whole.
        try:
            obj = json.loads(self.fmt.whole_call(block))  # type: ignore[union-attr]
        except json.JSONDecodeError:
            self._emit(out, "content", block)
            return
        args = obj.get("arguments", obj.get("parameters")) if isinstance(obj, dict) else None
        if (
            not isinstance(obj, dict)
            or not isinstance(obj.get("name"), str)
            or not isinstance(args, dict)
        ):
            self._emit(out, "content", block)
            return
        call = ToolCall(
            len(self.calls),
            "call_" + uuid.uuid4().hex[:24],
            obj["name"],
            [json.dumps(args, ensure_ascii=False)],
            "json",
            True,
        )
        self.calls.append(call)
        self._emit(out, "call", call.name, call.index, call.id)
        self._emit(out, "args", call.arguments[0], call.index)
