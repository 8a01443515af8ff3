"""gunicorn's error and access logs, routed through deltafind's structlog pipeline.

gunicorn's `Logger` adds its own handlers and stops propagation; this subclass
adds none and lets records reach the root handler `configure_logging` set up,
and logs each access as one event with fields instead of a formatted line.
"""

from __future__ import annotations

import logging
from typing import Any

from gunicorn import glogging

from deltafind.log import get_logger

access_log = get_logger("deltafind.access")


class Logger(glogging.Logger):
    def setup(self, cfg: Any) -> None:
        self.cfg = cfg
        self.loglevel = self.LOG_LEVELS.get(cfg.loglevel.lower(), logging.INFO)
        for log in (self.error_log, self.access_log):
            for handler in list(log.handlers):
                log.removeHandler(handler)
            log.propagate = True
        self.error_log.setLevel(self.loglevel)
        self.access_log.setLevel(logging.INFO)

    @property
    def access_log_enabled(self) -> bool:
        return True

    def access(self, resp: Any, req: Any, environ: dict, request_time: Any) -> None:
        status = str(resp.status).split(None, 1)[0]
        headers = dict((k.lower(), v) for k, v in (resp.headers or []))
        access_log.info(
            "http_request",
            method=environ.get("REQUEST_METHOD"),
            path=environ.get("PATH_INFO"),
            status=int(status) if status.isdigit() else status,
            bytes=getattr(resp, "sent", None),
            duration_ms=round(request_time.total_seconds() * 1000, 2),
            remote=environ.get("REMOTE_ADDR") or "unix",
            request_id=headers.get("x-request-id"),
            user_agent=environ.get("HTTP_USER_AGENT"),
        )

    def reopen_files(self) -> None:
        pass

    def close_on_exec(self) -> None:
        pass
