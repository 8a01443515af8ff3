"""The gunicorn worker: gthread, plus SIGHUP = reload in place and SIGTERM = drain.

gthread keeps heartbeating the arbiter from its own loop while request threads
and the engine thread work, so a long step never looks like a hung worker.
gunicorn's own SIGHUP would start a second worker (a second model in memory);
the arbiter forwards SIGHUP here instead and the running worker re-reads its config.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

from gunicorn.workers.gthread import ThreadWorker

from deltafind.daemon import notify
from deltafind.log import get_logger

log = get_logger(__name__)
CANCEL_MARGIN_S = 1.0  # cancel this long before gunicorn's grace ends, so streams can close cleanly


class Worker(ThreadWorker):
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
            threading.Thread(target=self._drain, args=(rt, grace), name="deltafind-stop", daemon=True).start()
        super().handle_exit(sig, frame)

    @staticmethod
    def _drain(rt: Any, grace: float) -> None:
        notify.stopping()
        rt.drain(grace_s=grace)
