"""Streaming text out of generated ids: UTF-8-safe incremental decode and stop strings.

Owns the two pieces the server chains per request, id -> text (IncrementalDecoder)
and text -> text-to-send (StopMatcher). Neither knows the engine: the server cancels
the sequence when a stop string is hit, as vLLM's frontend does.
"""

from __future__ import annotations

from typing import Protocol


def held_len(buf: str, markers: list[str]) -> int:
    """How many trailing chars of `buf` might begin one of `markers` (held back until they cannot)."""
    best = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(buf)), best, -1):
            if m.startswith(buf[-n:]):
                best = n
                break
    return best


class _Decodes(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...


class IncrementalDecoder:
    """Turn ids into text one at a time, never emitting half a UTF-8 character.

    Decodes a short window of ids and emits only what is new past the window's
    previous text, so decoders that look at neighbours (SentencePiece's leading
    space, byte fallback) still come out as the full decode does. An id whose bytes
    end mid-character is held until the character completes (or until `flush`).
    """

    def __init__(self, tokenizer: _Decodes, skip_special_tokens: bool = False) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_idx = 0  # start of the window still needed for context
        self._read_idx = 0  # ids before this have been emitted

    def _decode(self, start: int, stop: int | None = None) -> str:
        return self._tok.decode(self._ids[start:stop], skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """Add one id; returns the text it completed (often "", never a broken character)."""
        self._ids.append(token_id)
        prefix = self._decode(self._prefix_idx, self._read_idx)
        text = self._decode(self._prefix_idx)
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self._prefix_idx, self._read_idx = self._read_idx, len(self._ids)
            # Drop ids no longer needed as context, so the list stays short.
            del self._ids[: self._prefix_idx]
            self._read_idx -= self._prefix_idx
            self._prefix_idx = 0
            return text[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Whatever is held back (malformed bytes come out as U+FFFD); resets the decoder."""
        prefix = self._decode(self._prefix_idx, self._read_idx)
        text = self._decode(self._prefix_idx)
        self._ids, self._prefix_idx, self._read_idx = [], 0, 0
        return text[len(prefix) :] if len(text) > len(prefix) else ""


class StopMatcher:
    """Cut streamed text at the first stop string.

    `push` returns the text that can be sent now and whether a stop was hit. Text
    that might be the start of a stop string is held back until it is not. On a hit,
    the text before the stop is returned and the stop itself never is. "First" is
    the stop that ends earliest in the text (ties: the one starting earliest), which
    is what a token-by-token check sees first.
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in dict.fromkeys(stops) if s]  # "" would stop at once
        self._buf = ""
        self.stopped = False
        self.hit: str | None = None  # the stop string that was hit

    def _first_hit(self) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None
        for stop in self.stops:
            idx = self._buf.find(stop)
            if idx >= 0 and (best is None or (idx + len(stop), idx) < best[:2]):
                best = (idx + len(stop), idx, stop)
        return None if best is None else (best[1], best[2])

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; returns (text safe to send now, whether a stop string was hit)."""
        if self.stopped:
            return "", True
        self._buf += text
        found = self._first_hit()
        if found is not None:
            idx, self.hit = found
            out, self._buf, self.stopped = self._buf[:idx], "", True
            return out, True
        held = held_len(self._buf, self.stops)
        out = self._buf[: len(self._buf) - held]
        self._buf = self._buf[len(self._buf) - held :]
        return out, False

    def flush(self) -> str:
        """The held-back text at the end of the stream ("" after a stop)."""
        out, self._buf = ("" if self.stopped else self._buf), ""
        return out
