"""Bounds on slow clients for the gthread worker: headers read in the poller, bodies against a deadline.

gthread hands a connection to a pool thread as soon as its first byte arrives, and
the thread then blocks until the headers are complete: a hundred clients trickling
headers hold every thread and /health stops answering. Here the main loop gathers
each request head without a thread and closes a connection whose head is not
complete within server.header_timeout_s (408); a thread only gets complete heads.
The body is read in the request thread through a socket whose every recv is bounded
by what is left of server.body_timeout_s, so a trickled body ends in a 408 too; a
chunked body whose declared chunk sizes pass server.max_body_bytes is refused (400)
as soon as the size line says so, not after the timeout.
Also renders gunicorn's own error answers (400/408/414/431/...) as OpenAI JSON.
"""

from __future__ import annotations

import contextlib
import errno
import json
import re
import socket
import time
from collections import deque
from http import HTTPStatus
from typing import Any

from gunicorn.http.body import Body, ChunkedReader
from gunicorn.http.errors import InvalidChunkSize
from gunicorn.http.message import Request

from deltafind.log import get_logger
from deltafind.server.errors import ApiError

log = get_logger(__name__)
HEAD_END = b"\r\n\r\n"
RECV_BYTES = 65536
CODES = {
    408: "request_timeout",
    414: "uri_too_long",
    431: "headers_too_large",
    501: "unsupported_transfer_coding",
}


def error_response(status: int, message: str) -> bytes:
    """A complete `Connection: close` HTTP/1.1 answer with an OpenAI-shaped error body (`status`: a standard code)."""
    code = CODES.get(status, "invalid_request" if status < 500 else "internal_error")
    reason = HTTPStatus(status).phrase
    body = json.dumps(ApiError(status, message or reason, None, code).body()).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode("latin-1") + body


class DeadlineSocket(socket.socket):
    """A connection's socket (it takes over the accepted one's descriptor): once `arm`ed for a request,
    recv returns the head gathered in the main loop first, then may wait only until `deadline`;
    the blocking mode is restored after every such read. A peek (`flags`) reads the socket itself."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock.family, sock.type, sock.proto, fileno=sock.detach())
        self.deadline: float | None = None
        self.pending = b""

    def arm(self, head: bytes, deadline: float | None) -> None:
        self.pending, self.deadline = self.pending + head, deadline

    def recv(self, size: int, flags: int = 0) -> bytes:
        if self.pending and not flags:
            data, self.pending = self.pending[:size], self.pending[size:]
            return data
        if self.deadline is None or flags:
            return super().recv(size, flags)
        prior = self.gettimeout()
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(errno.ETIMEDOUT, "request body read timed out")
        self.settimeout(left if prior is None else min(left, prior))
        try:
            return super().recv(size)
        finally:
            self.settimeout(prior)


class ChunkTooLarge(InvalidChunkSize):
    def __init__(self, declared: int, limit: int) -> None:
        super().__init__(b"")
        self.declared, self.limit = declared, limit

    def __str__(self) -> str:
        return (
            f"the chunked body declares {self.declared} bytes so far; the limit is {self.limit} bytes "
            "(server.max_body_bytes)"
        )


HEX_DIGITS = re.compile(rb"[0-9a-fA-F]*")


class BoundedChunkedReader(ChunkedReader):
    """gunicorn's chunked body reader, refusing a body whose chunk sizes add up past `limit` bytes.

    gunicorn reads a declared chunk until it is all there: a size past the limit (or a size line
    whose digits already pass it) would otherwise wait for the body timeout before any answer.
    """

    def __init__(self, req: Any, unreader: Any, limit: int) -> None:
        super().__init__(req, unreader)
        self.limit, self.declared, self._sizing = limit, 0, False

    def parse_chunk_size(self, unreader: Any, data: bytes | None = None) -> tuple[int, Any]:
        self._sizing = True
        self._check(data or b"")
        size, rest = super().parse_chunk_size(unreader, data)
        self.declared += size
        if self.declared > self.limit:
            raise ChunkTooLarge(self.declared, self.limit)
        return size, rest

    def parse_trailers(self, unreader: Any, data: bytes) -> Any:
        self._sizing = False  # trailer lines are headers, not sizes
        return super().parse_trailers(unreader, data)

    def read_into(self, unreader: Any, buf: bytearray) -> None:
        super().read_into(unreader, buf)
        if self._sizing:  # a size line still without its CRLF
            self._check(buf)

    def _check(self, line: bytes | bytearray) -> None:
        m = HEX_DIGITS.match(line)
        digits = m.group().lstrip(b"0") if m else b""
        if len(digits) > 16 or (digits and self.declared + int(digits, 16) > self.limit):
            raise ChunkTooLarge(self.declared + int(digits[:17], 16), self.limit)


class BoundedRequest(Request):
    """gunicorn's request with its chunked body read by `BoundedChunkedReader` (set as the parser's mesg_class)."""

    def __init__(self, max_body_bytes: int, *args: Any) -> None:
        self.max_body_bytes = max_body_bytes  # before the parse below, which builds the body reader
        super().__init__(*args)

    def set_body_reader(self) -> None:
        super().set_body_reader()
        if isinstance(self.body.reader, ChunkedReader):
            self.body = Body(BoundedChunkedReader(self, self.unreader, self.max_body_bytes))


class HeadReader:
    """The request heads being gathered in the worker's main loop, oldest first."""

    def __init__(self, header_timeout_s: float, max_head_bytes: int) -> None:
        self.timeout_s, self.max_bytes = header_timeout_s, max_head_bytes
        self.waiting: deque[Any] = deque()

    def start(self, conn: Any) -> None:
        conn.head = bytearray()
        conn.head_deadline = time.monotonic() + self.timeout_s
        conn.sock.setblocking(False)
        self.waiting.append(conn)

    def feed(self, conn: Any) -> bool | None:
        """Read what arrived: True = the head is complete (or too big: the parser answers 431),
        None = the client closed, False = wait for more."""
        try:
            data = conn.sock.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return None
        if not data:
            return None
        conn.head += data
        # a bare-LF head too: gunicorn's parser then answers it (400) at once instead of after the timeout
        return HEAD_END in conn.head or b"\n\n" in conn.head or len(conn.head) > self.max_bytes

    def done(self, conn: Any) -> bytes:
        self.waiting.remove(conn)
        head, conn.head = bytes(conn.head), None
        return head

    def expired(self, now: float) -> list[Any]:
        out = []
        while self.waiting and self.waiting[0].head_deadline <= now:
            out.append(self.waiting.popleft())
        return out

    def idle(self) -> list[Any]:
        """Take out the connections that have sent nothing yet (a stopping worker closes them at once)."""
        out = [c for c in self.waiting if not c.head]
        for c in out:
            self.waiting.remove(c)
        return out

    def time_out(self, conn: Any) -> None:
        """Answer 408 (when the client sent anything) and close."""
        if conn.head:
            log.info(
                "request_head_timeout",
                client=str(conn.client),
                bytes=len(conn.head),
                timeout_s=self.timeout_s,
            )
            with contextlib.suppress(OSError):
                conn.sock.send(
                    error_response(
                        408,
                        f"the request headers did not arrive within {self.timeout_s:g} s "
                        "(server.header_timeout_s)",
                    )
                )
        conn.close()
