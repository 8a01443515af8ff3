"""Chat templates: jinja2 programs from the model's files, rendered as transformers does.

Templates come from downloaded models, so they run in a helper process
(template_worker.py) with its memory capped, stopped after RENDER_TIMEOUT_S: compiling,
jinja's constant folding, filters and str methods are all inside those bounds, and a
runaway template costs the helper a restart, never the daemon its memory or a thread.
A template that fails is the store's fault (StoreError); one that calls
raise_exception refused the request (RequestError). Knows nothing of ids.
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from deltafind.errors import DeltafindError, RequestError, StoreError

from .template_worker import MAX_RENDER_CHARS, MEMORY_BYTES

RENDER_TIMEOUT_S = 5.0  # real templates render in milliseconds
_WORKER = Path(__file__).with_name("template_worker.py")


class _Stopped(Exception):
    """The helper ran over its time, or died."""


class _Helper:
    """One renderer process, started on first use and again after it is stopped; one request at a time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None

    def ask(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        data = (json.dumps(request, default=str) + "\n").encode()
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                # -I: the helper sees only the standard library and jinja2, not the daemon's path; its own
                # session: a terminal's Ctrl-C (`deltafind run --chat`) stops the reply, not the renderer
                self._proc = subprocess.Popen(
                    [sys.executable, "-I", str(_WORKER)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    start_new_session=True,
                )
                weakref.finalize(self, _stop, self._proc)
            proc = self._proc
            try:
                assert proc.stdin is not None and proc.stdout is not None
                proc.stdin.write(data)
                proc.stdin.flush()
                line = _read_line(proc.stdout.fileno(), time.monotonic() + timeout_s)
            except (OSError, _Stopped) as e:
                _stop(proc)
                self._proc = None
                raise _Stopped(
                    str(e) if isinstance(e, _Stopped) else f"lost its renderer ({e})"
                ) from None
            if line is None:  # it exited: after a MemoryError it answers, then leaves
                self._proc = None
                raise _Stopped(f"lost its renderer (exit status {proc.wait()})")
            return json.loads(line.decode("utf-8", "surrogatepass"))


def _read_line(fd: int, deadline: float) -> bytes | None:
    chunks: list[bytes] = []
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                raise _Stopped(f"ran over {RENDER_TIMEOUT_S:g} s and was stopped")
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return None
            chunks.append(chunk)
            if chunk.endswith(b"\n"):
                return b"".join(chunks)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for f in (proc.stdin, proc.stdout):
        if f is not None:
            f.close()


class ChatTemplate:
    """A chat template, compiled and rendered in its helper, and the file it came from (named in every error)."""

    def __init__(self, source: str, origin: str) -> None:
        self.origin, self._source = origin, source
        self._helper = _Helper()
        self._ask({"source": source})

    def _ask(self, request: dict[str, Any]) -> str:
        where, fix = (
            f"the chat template in {self.origin}",
            "the store's template is at fault, not the request: fix or replace it",
        )
        try:
            answer = self._helper.ask(request, RENDER_TIMEOUT_S)
        except _Stopped as e:
            raise StoreError(f"{where} {e}; {fix}") from None
        kind, message = answer.get("error"), answer.get("message")
        if kind is None:
            return answer["text"]
        if kind == "compile":
            raise DeltafindError(f"chat template in {self.origin} does not compile: {message}")
        if kind == "raised":
            raise RequestError(
                f"the chat template ({self.origin}) rejected the messages: {message}", "messages"
            )
        if kind in ("too_large", "memory"):
            raise StoreError(
                f"{where} built more than {MAX_RENDER_CHARS} characters or {MEMORY_BYTES >> 20} MiB "
                f"({message}) and was stopped; {fix}"
            )
        raise StoreError(f"{where} failed: {message}; {fix}")

    def render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render `messages`; `kwargs` (tools, documents, bos_token, ...) become template variables."""
        return self._ask(
            {
                "source": self._source,
                "messages": messages,
                "add_generation_prompt": add_generation_prompt,
                "kwargs": kwargs,
            }
        )
