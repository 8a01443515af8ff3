"""deltafind.log: one pipeline for structlog and stdlib records, JSON or console."""

from __future__ import annotations

import io
import json
import logging
import os
from collections.abc import Iterator
from datetime import datetime

import pytest
import structlog
from structlog.testing import capture_logs

from deltafind.log import configure_logging, get_logger, use_json


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    structlog.contextvars.clear_contextvars()
    structlog.reset_defaults()
    root.handlers[:] = handlers
    root.setLevel(level)


def lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_lines_carry_event_fields_level_and_iso_time() -> None:
    stream = io.StringIO()
    configure_logging("info", "json", stream)
    get_logger("deltafind.store").info("expert_read", layer=3, expert=7, bytes=4096)
    [line] = lines(stream)
    assert line["event"] == "expert_read"
    assert (line["layer"], line["expert"], line["bytes"]) == (3, 7, 4096)
    assert line["level"] == "info"
    assert line["logger"] == "deltafind.store"
    assert datetime.fromisoformat(line["timestamp"].replace("Z", "+00:00")).tzinfo is not None


def test_stdlib_records_go_through_the_same_pipeline() -> None:
    stream = io.StringIO()
    configure_logging("info", "json", stream)
    structlog.contextvars.bind_contextvars(request_id="req-1")
    logging.getLogger("gunicorn.error").warning("worker %s booted", 12, extra={"pid": 12})
    get_logger("deltafind.server").info("request_done", status=200)
    stdlib, ours = lines(stream)
    assert stdlib["event"] == "worker 12 booted"
    assert (stdlib["level"], stdlib["logger"], stdlib["pid"]) == ("warning", "gunicorn.error", 12)
    assert stdlib["request_id"] == ours["request_id"] == "req-1"
    assert set(stdlib) >= {"timestamp", "level", "logger", "event"}
    structlog.contextvars.clear_contextvars()
    get_logger("deltafind.server").info("idle")
    assert "request_id" not in lines(stream)[-1]


def test_exceptions_render_as_a_field() -> None:
    stream = io.StringIO()
    configure_logging("info", "json", stream)
    try:
        raise ZeroDivisionError("division by zero")
    except ZeroDivisionError:
        get_logger("deltafind.engine").exception("step_failed", step=5)
        logging.getLogger("falcon").exception("handler_failed")
    for line in lines(stream):
        assert "ZeroDivisionError" in line["exception"]
        assert line["level"] == "error"


def test_level_filters_and_reconfigure_changes_it_without_duplicates() -> None:
    stream = io.StringIO()
    log = get_logger("deltafind.cache")  # made before configuration, as at import time
    configure_logging("info", "json", stream)
    log.debug("cache_probe")
    logging.getLogger("other").debug("stdlib_probe")
    assert stream.getvalue() == ""
    configure_logging("DEBUG", "json", stream)
    log.debug("cache_probe")
    logging.getLogger("other").debug("stdlib_probe")
    assert [line["event"] for line in lines(stream)] == ["cache_probe", "stdlib_probe"]
    handlers = logging.getLogger().handlers
    assert sum(type(h).__module__ == "deltafind.log" for h in handlers) == 1


def test_console_format_is_for_people() -> None:
    stream = io.StringIO()
    configure_logging("info", "console", stream)
    get_logger("deltafind.store").info("expert_read", layer=3)
    text = stream.getvalue()
    assert "expert_read" in text and "layer" in text and "3" in text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    assert "\x1b[" not in text  # no colours off a TTY


def test_auto_format_json_off_a_tty_console_on_one(monkeypatch: pytest.MonkeyPatch) -> None:
    assert use_json("auto", io.StringIO())
    assert use_json("json", io.StringIO())
    assert not use_json("console", io.StringIO())
    master, slave = os.openpty()
    try:
        with os.fdopen(slave, "w", closefd=False) as tty:
            # Inherited by shells in terminal emulators: not enough to mean "service".
            inherited = {
                "INVOCATION_ID": "abc",
                "XPC_SERVICE_NAME": "app.term",
                "JOURNAL_STREAM": "1:2",
            }
            assert not use_json("auto", tty, inherited)
            st = os.fstat(slave)
            assert use_json("auto", tty, {"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"})
            assert use_json("json", tty, {})
    finally:
        os.close(slave)
        os.close(master)


def test_capture_logs_sees_loggers_after_configuration() -> None:
    log = get_logger("deltafind.prefetch")
    configure_logging("info", "json", io.StringIO())
    log.info("warm")
    with capture_logs() as captured:
        log.info("prefetch_issued", expert=3)
    assert captured == [{"event": "prefetch_issued", "expert": 3, "log_level": "info"}]


def test_bad_level_or_format_is_refused() -> None:
    with pytest.raises(ValueError, match="log level must be one of debug, info, warning, error"):
        configure_logging("loud")
    with pytest.raises(ValueError, match="log format must be one of auto, json, console"):
        configure_logging("info", "xml")
