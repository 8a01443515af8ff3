"""What deltafind/daemon/worker.py relies on in gunicorn, checked on the installed release.

The worker subclasses gunicorn's ThreadWorker (no patching of gunicorn's modules): it overrides
`handle_error`, `accept`, `on_client_socket_readable`, `murder_pending` and `handle`, and hands
gunicorn's connection (TConn) a socket wrapper. A gunicorn upgrade that changes any of these
fails here with the member's name, before the daemon answers HTML or hangs on a slow client.
"""

from __future__ import annotations

import inspect
import json
import logging
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import gunicorn
import pytest
from gunicorn.config import Config
from gunicorn.glogging import Logger
from gunicorn.http import errors
from gunicorn.http.message import Request
from gunicorn.http.parser import Parser, RequestParser
from gunicorn.workers.gthread import TConn, ThreadWorker

from deltafind.daemon.slow_clients import DeadlineSocket
from deltafind.daemon.worker import Worker

OVERRIDDEN = {
    "handle_error": ["req", "client", "addr", "exc"],
    "accept": ["listener"],
    "handle": ["conn"],
    "on_client_socket_readable": ["conn", "client"],
    "murder_pending": [],
    "enqueue_req": ["conn"],
    "init_process": [],
    "init_signals": [],
    "handle_exit": ["sig", "frame"],
}
UPGRADE = "deltafind/daemon/worker.py relies on it: re-check the worker against this gunicorn before raising the pin"


def test_the_installed_gunicorn_is_within_the_pinned_major() -> None:
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    low, high = map(int, re.search(r'"gunicorn>=(\d+)[.\d]*,<(\d+)"', pyproject).groups())  # type: ignore[union-attr]
    assert high == low + 1, "pyproject must pin gunicorn to one major version"
    assert low <= gunicorn.version_info[0] < high, (
        f"gunicorn {gunicorn.__version__} is outside the pin; {UPGRADE}"
    )


def test_the_overridden_members_keep_their_signatures() -> None:
    for name, params in OVERRIDDEN.items():
        member = getattr(ThreadWorker, name, None)
        assert member is not None, f"gunicorn's ThreadWorker.{name} is gone; {UPGRADE}"
        assert list(inspect.signature(member).parameters)[1:] == params, (
            f"ThreadWorker.{name} changed; {UPGRADE}"
        )
    assert list(inspect.signature(TConn).parameters) == ["cfg", "sock", "client", "server"], (
        f"TConn changed; {UPGRADE}"
    )
    handle = inspect.getsource(ThreadWorker.handle)
    assert "self.handle_error(" in handle and "conn.data_ready" in handle, (
        f"ThreadWorker.handle changed; {UPGRADE}"
    )
    assert "conn.init()" in handle and "next(conn.parser)" in handle, (
        f"ThreadWorker.handle changed; {UPGRADE}"
    )
    # worker.Conn sets the parser's message class (BoundedRequest) once TConn.init has built the parser
    assert RequestParser.mesg_class is Request and "self.mesg_class(" in inspect.getsource(
        Parser.__next__
    ), f"gunicorn's parser no longer builds messages from mesg_class; {UPGRADE}"
    assert "self.parser = " in inspect.getsource(TConn.init), (
        f"TConn.init no longer builds the parser; {UPGRADE}"
    )


@pytest.fixture(autouse=True)
def _gunicorn_loggers_restored() -> Iterator[None]:
    """gunicorn's Logger(cfg) gives its `gunicorn.*` loggers their own handlers and stops propagation, for the
    whole process: put them back, so later tests see deltafind's logging pipeline as the daemon sets it up."""
    saved = {
        n: (lg.handlers[:], lg.propagate, lg.level)
        for n in ("gunicorn.error", "gunicorn.access")
        for lg in [logging.getLogger(n)]
    }
    yield
    for name, (handlers, propagate, level) in saved.items():
        lg = logging.getLogger(name)
        lg.handlers[:], lg.propagate, lg.level = handlers, propagate, level


def _worker() -> Worker:
    cfg = Config()
    return Worker(0, 0, [], None, 30, cfg, Logger(cfg))


def test_a_parse_error_is_answered_as_openai_json_by_the_subclass() -> None:
    ours, theirs = socket.socketpair()
    with DeadlineSocket(ours) as wrapped, theirs:
        _worker().handle_error(
            None, wrapped, ("127.0.0.1", 1), errors.LimitRequestHeaders("too many")
        )
        answer = theirs.recv(65536)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 "), head
    assert json.loads(body)["error"]["message"] == "too many"


def test_gunicorns_parser_reads_the_gathered_head_then_the_body_through_the_wrapper() -> None:
    ours, theirs = socket.socketpair()
    with DeadlineSocket(ours) as wrapped, theirs:
        conn = TConn(Config(), wrapped, ("127.0.0.1", 1), ("127.0.0.1", 2))
        wrapped.arm(
            b"POST /v1/x HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n\r\n", time.monotonic() + 5
        )
        theirs.sendall(b"hello")
        conn.init()
        req = next(conn.parser)
        assert (req.method, req.path, req.body.read()) == ("POST", "/v1/x", b"hello")
        assert conn.sock is wrapped and isinstance(
            wrapped, socket.socket
        )  # what the server and the poller see
