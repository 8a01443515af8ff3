"""`deltafind serve`: gunicorn embedded as a BaseApplication, configured from Settings.

One gthread worker owns the model (a second would load a second spine); it is
loaded in the worker after fork (post_worker_init), never with preload_app, since
CUDA and OpenMP do not survive fork. The arbiter hides NOTIFY_SOCKET from gunicorn
(which would send READY=1 on bind) and forwards SIGHUP to the worker. gunicorn's
error and access logs go through deltafind's structlog pipeline (`Logger`).
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import Any

from gunicorn import glogging
from gunicorn.app.base import BaseApplication
from gunicorn.arbiter import Arbiter

from deltafind.config import Settings
from deltafind.daemon import notify
from deltafind.log import get_logger
from deltafind.server import AppState, create_app

log = get_logger(__name__)
access_log = get_logger("deltafind.access")


def binds(settings: Settings) -> list[str]:
    s = settings.server
    host = f"[{s.host}]" if ":" in s.host and not s.host.startswith("[") else s.host
    out = [f"{host}:{s.port}"]
    if s.unix_socket is not None:
        out.append(f"unix:{s.unix_socket}")
    return out


class Logger(glogging.Logger):
    """gunicorn's logs without handlers of their own: records reach the root handler `configure_logging`
    set up, and each access is one event with fields instead of a formatted line."""

    def setup(self, cfg: Any) -> None:
        self.cfg = cfg
        self.loglevel = self.LOG_LEVELS.get(cfg.loglevel.lower(), logging.INFO)
        for logger in (self.error_log, self.access_log):
            for handler in list(logger.handlers):
                logger.removeHandler(handler)
            logger.propagate = True
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


class _Arbiter(Arbiter):
    def handle_hup(self) -> None:
        """Reload in the running worker (the ctl Reload), not gunicorn's new-worker reload."""
        self.log.info("Hang up: reloading config in the worker")
        self.kill_workers(signal.SIGHUP)


class DaemonApp(BaseApplication):
    def __init__(
        self, settings: Settings, config_path: Path | None, overrides: dict[str, Any]
    ) -> None:
        self.settings, self.config_path, self.overrides = settings, config_path, overrides
        self.runtime: Any = None
        self.state: AppState | None = None
        super().__init__()

    def load_config(self) -> None:
        s = self.settings.server
        options = {
            "bind": binds(self.settings),
            "workers": 1,
            "worker_class": "deltafind.daemon.worker.Worker",
            "threads": min(s.max_running + s.max_queue + 8, 256),
            "timeout": max(1, round(s.timeout_s)),  # gunicorn takes whole seconds
            "graceful_timeout": max(0, round(s.graceful_timeout_s)),
            "keepalive": 5,
            "preload_app": False,
            "logger_class": "deltafind.daemon.app.Logger",
            "loglevel": self.settings.logging.level,
            "control_socket_disable": True,
            "umask": 0o007,  # a unix: bind gets 0770, not gunicorn's world-writable default
            "proc_name": "deltafind",
            "post_worker_init": self._post_worker_init,
            "worker_exit": self._worker_exit,
        }
        for key, value in options.items():
            if key in self.cfg.settings:
                self.cfg.set(key, value)

    def load(self) -> Any:
        from deltafind.compose import model_name, server_config

        self.state = AppState(server_config(self.settings), model_name(self.settings))
        return create_app(self.state)

    def _post_worker_init(self, worker: Any) -> None:
        from deltafind.daemon.runtime import Runtime

        assert self.state is not None
        self.runtime = Runtime(self.settings, self.config_path, self.overrides, self.state)
        self.runtime.start()

    def _worker_exit(self, arbiter: Any, worker: Any) -> None:
        if self.runtime is not None:
            self.runtime.close()

    def run(self) -> None:
        notify.take_environment()
        try:
            _Arbiter(self).run()
        except RuntimeError as e:
            log.error("gunicorn_failed", error=str(e))
            raise SystemExit(1) from None
