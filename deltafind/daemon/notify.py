"""sd_notify by hand: READY/STATUS/WATCHDOG/RELOADING/STOPPING to $NOTIFY_SOCKET.

gunicorn's arbiter sends its own READY=1 as soon as it binds, before any model
is loaded, so `take_environment` moves NOTIFY_SOCKET (and the watchdog
variables) out of the environment before gunicorn starts; the worker, forked
with this module's copy, sends READY=1 after load and warm-up (the unit needs
NotifyAccess=all). The only module that touches systemd's variables.
"""

from __future__ import annotations

import os
import socket
import threading
import time

_socket_path: str | None = None
_watchdog_usec: int | None = None


def take_environment() -> None:
    """Keep NOTIFY_SOCKET/WATCHDOG_USEC for ourselves and hide them from gunicorn."""
    global _socket_path, _watchdog_usec
    _socket_path = os.environ.pop("NOTIFY_SOCKET", None) or _socket_path
    usec = os.environ.pop("WATCHDOG_USEC", None)
    pid = os.environ.pop("WATCHDOG_PID", None)
    if usec and usec.isdigit() and (pid is None or pid == str(os.getpid())):
        _watchdog_usec = int(usec)


def notify(*lines: str) -> bool:
    """Send `KEY=value` lines in one datagram; False when there is no socket or it fails."""
    path = _socket_path
    if not path:
        return False
    addr = "\0" + path[1:] if path.startswith("@") else path
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall("\n".join(lines).encode())
        return True
    except OSError:
        return False


def status(text: str) -> None:
    notify(f"STATUS={text}")


def ready(text: str) -> None:
    notify("READY=1", f"STATUS={text}")


def reloading() -> None:
    notify("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")


def stopping() -> None:
    notify("STOPPING=1", "STATUS=draining")


def extend_timeout(seconds: float) -> None:
    notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")


def start_watchdog(healthy: object, stop: threading.Event) -> None:
    """WATCHDOG=1 every WATCHDOG_USEC/2 while `healthy()` holds (nothing without a watchdog)."""
    if not _watchdog_usec:
        return
    interval = _watchdog_usec / 2e6

    def run() -> None:
        while not stop.wait(interval):
            if healthy():  # type: ignore[operator]
                notify("WATCHDOG=1")

    threading.Thread(target=run, name="deltafind-watchdog", daemon=True).start()
