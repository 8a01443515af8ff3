"""Logging: one structlog pipeline for structlog and stdlib records.

`configure_logging` runs at startup and again on reload; `get_logger` works
anywhere, before or after. Output is JSON lines for machines and structlog's
console renderer for people. This module knows nothing of config files.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from typing import IO

import structlog
from structlog.stdlib import ProcessorFormatter
from structlog.typing import Processor

LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}
FORMATS = ("auto", "json", "console")


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """Our root handler, told apart from others so reconfiguring replaces it."""


def configure_logging(
    level: str | int = "info", fmt: str = "auto", stream: IO[str] | None = None
) -> None:
    """Route structlog and stdlib logging through one renderer on `stream`.

    Args:
        level: "debug", "info", "warning", "error" (any case) or a logging int.
        fmt: "json", "console", or "auto": JSON lines unless `stream` is a
            TTY (and not the journal), the console renderer on a TTY.
        stream: where lines go; default `sys.stderr` at call time.

    Calling it again replaces the previous setup (no duplicate handlers), so
    reload can change the level.
    """
    if isinstance(level, str) and level.lower() in LEVELS:
        numeric = LEVELS[level.lower()]
    elif isinstance(level, int) and not isinstance(level, bool):
        numeric = level
    else:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)} (got {level!r})")
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)} (got {fmt!r})")
    stream = stream if stream is not None else sys.stderr

    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    final: list[Processor]
    if use_json(fmt, stream):
        final = [
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(default=str),
        ]
    else:
        final = [structlog.dev.ConsoleRenderer(colors=_isatty(stream))]

    # Not cached on first use: loggers made at import time must follow a later
    # configure_logging (reload) and structlog.testing.capture_logs.
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.processors.StackInfoRenderer(),
            ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    handler = _Handler(stream)
    handler.setFormatter(
        ProcessorFormatter(
            # stdlib records (gunicorn, libraries) get the same fields; `extra=` becomes fields.
            foreign_pre_chain=[*shared, structlog.stdlib.ExtraAdder()],
            processors=[ProcessorFormatter.remove_processors_meta, *final],
        )
    )
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)


def get_logger(name: str | None = None) -> structlog.stdlib.BoundLogger:
    """A structlog logger (stdlib-backed) named `name`, e.g. `__name__`."""
    return structlog.stdlib.get_logger(name)


def use_json(fmt: str, stream: IO[str], environ: Mapping[str, str] | None = None) -> bool:
    """Whether `fmt` on `stream` means JSON lines.

    "auto" picks JSON when the stream is no TTY (a file, pipe, launchd's
    StandardErrorPath) or is the systemd journal. JOURNAL_STREAM counts only
    when it names this very stream, as systemd documents: terminal emulators
    started as user services pass it (and INVOCATION_ID, XPC_SERVICE_NAME)
    on to interactive shells, where JSON would be wrong.
    """
    if fmt != "auto":
        return fmt == "json"
    return _is_journal(stream, os.environ if environ is None else environ) or not _isatty(stream)


def _isatty(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


def _is_journal(stream: IO[str], environ: Mapping[str, str]) -> bool:
    dev, _, ino = environ.get("JOURNAL_STREAM", "").partition(":")
    try:
        st = os.fstat(stream.fileno())
        return f"{st.st_dev}:{st.st_ino}" == f"{dev}:{ino}"
    except (AttributeError, ValueError, OSError):  # no file descriptor (StringIO, closed)
        return False
