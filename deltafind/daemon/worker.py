"""The gunicorn worker: gthread, plus SIGHUP = reload in place, SIGTERM = drain, slow clients bounded.

gthread keeps heartbeating the arbiter from its own loop while request threads
and the engine thread work, so a long step never looks like a hung worker.
gunicorn's own SIGHUP would start a second worker (a second model in memory);
the arbiter forwards SIGHUP here instead and the running worker re-reads its config.
Request heads are gathered in the main loop, not in pool threads (slow_clients.py). Only
ThreadWorker's overridable methods are used (gunicorn pinned to one major version; a unit test checks them).
"""

from __future__ import annotations

import contextlib
import errno
import selectors
import signal
import threading
import time
from functools import partial
from typing import Any

import structlog
from gunicorn.http import errors as http_errors
from gunicorn.http.parser import RequestParser
from gunicorn.workers.gthread import TConn, ThreadWorker

from deltafind.daemon import notify
from deltafind.daemon.slow_clients import BoundedRequest, DeadlineSocket, HeadReader, error_response
from deltafind.log import get_logger

log = get_logger(__name__)
CANCEL_MARGIN_S = 1.0  # cancel this long before gunicorn's grace ends, so streams can close cleanly
MAX_HEAD_BYTES = (
    64 << 10
)  # a bigger head goes to gunicorn's parser, which answers 431 past its limits
# gunicorn's own answers to what its parser refuses (the statuses of its Worker.handle_error); first match wins
ERROR_STATUS = (
    (http_errors.InvalidResponseHeader, 500),
    (http_errors.InvalidResponseHeaderName, 500),
    (http_errors.ConfigurationProblem, 500),
    (http_errors.LimitRequestLine, 414),
    (http_errors.LimitRequestHeaders, 431),
    (http_errors.UnsupportedTransferCoding, 501),
    (http_errors.ExpectationFailed, 417),
    (http_errors.ForbiddenProxyRequest, 403),
    (http_errors.ParseException, 400),
)


class Conn(TConn):
    """gthread's connection whose HTTP/1 parser builds `BoundedRequest`: a chunk past the body limit is a 400 at once."""

    def __init__(self, max_body_bytes: int, *args: Any) -> None:
        self.max_body_bytes = max_body_bytes
        super().__init__(*args)

    def init(self) -> None:
        super().init()
        # the class RequestParser builds each message with (a hooks test checks it)
        if isinstance(self.parser, RequestParser):
            self.parser.mesg_class = partial(BoundedRequest, self.max_body_bytes)


class Worker(ThreadWorker):
    def init_process(self) -> None:
        server = self.app.settings.server
        self.heads = HeadReader(server.header_timeout_s, MAX_HEAD_BYTES)
        self.body_timeout_s = server.body_timeout_s
        self.max_body_bytes = int(server.max_body_bytes)
        super().init_process()

    def handle_error(self, req: Any, client: Any, addr: Any, exc: BaseException) -> None:
        """gunicorn's own error answers (400/414/431/501/500...) as OpenAI JSON instead of its HTML page."""
        status = next((s for kind, s in ERROR_STATUS if isinstance(exc, kind)), 500)
        log.warning(
            "http_error",
            client=str(addr),
            status=status,
            error=str(exc),
            exc_info=exc if status == 500 else None,
        )
        with contextlib.suppress(OSError):
            client.sendall(error_response(status, str(exc) if status != 500 else ""))

    # -- request heads, read without a thread ---------------------------------

    def accept(self, listener: Any) -> None:
        try:
            client_sock, client_addr = listener.accept()
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.ECONNABORTED, errno.EWOULDBLOCK):
                raise
            return
        self.nr_conns += 1
        self._read_head(
            Conn(
                self.max_body_bytes,
                self.cfg,
                DeadlineSocket(client_sock),
                client_addr,
                listener.getsockname(),
            )
        )

    def on_client_socket_readable(self, conn: Any, client: Any) -> None:
        self.poller.unregister(client)
        self.keepalived_conns.remove(conn)
        self._read_head(conn)

    def _read_head(self, conn: Any) -> None:
        self.heads.start(conn)
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self._on_head_readable, conn))

    def _on_head_readable(self, conn: Any, client: Any) -> None:
        state = self.heads.feed(conn)
        if state is False:
            return
        self.poller.unregister(client)
        head = self.heads.done(conn)
        if state is None:  # closed before a whole head arrived
            self.nr_conns -= 1
            conn.close()
            return
        conn.sock.arm(head, None)  # what gunicorn's parser reads first
        self.enqueue_req(conn)

    def murder_pending(self) -> None:
        super().murder_pending()
        for conn in self.heads.expired(time.monotonic()) + (
            [] if self.alive else self.heads.idle()
        ):
            with contextlib.suppress(OSError, KeyError, ValueError):
                self.poller.unregister(conn.sock)
            self.nr_conns -= 1
            self.heads.time_out(conn)

    def handle(self, conn: Any) -> Any:
        structlog.contextvars.clear_contextvars()  # gunicorn's own errors must not log the thread's last request id
        conn.data_ready = conn.data_ready or bool(
            conn.sock.pending
        )  # a gathered head: gthread need not wait for a byte
        conn.sock.arm(
            b"", time.monotonic() + self.body_timeout_s
        )  # the body (and a pipelined head) by this deadline
        try:
            return super().handle(conn)
        finally:
            conn.sock.arm(
                b"", None
            )  # the next head is gathered without a deadline (HeadReader has its own)

    # -- signals ------------------------------------------------------------------

    def init_signals(self) -> None:
        super().init_signals()
        signal.signal(signal.SIGHUP, self.handle_hup)

    @property
    def runtime(self) -> Any:
        return getattr(self.app, "runtime", None)

    def handle_hup(self, sig: int, frame: Any) -> None:
        rt = self.runtime
        if rt is not None:
            threading.Thread(target=rt.reload, name="deltafind-reload", daemon=True).start()

    def handle_exit(self, sig: int, frame: Any) -> None:
        rt = self.runtime
        if self.alive and rt is not None:
            grace = max(0.0, float(self.cfg.graceful_timeout) - CANCEL_MARGIN_S)
            # Not in the handler itself: it may interrupt a thread holding a lock drain needs.
            threading.Thread(
                target=self._drain, args=(rt, grace), name="deltafind-stop", daemon=True
            ).start()
        super().handle_exit(sig, frame)

    @staticmethod
    def _drain(rt: Any, grace: float) -> None:
        notify.stopping()
        rt.drain(grace_s=grace)
