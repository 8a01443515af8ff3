"""The control service (grpclib) on a Unix socket, run in the worker on its own thread.

Calls a target object (the daemon's Runtime): status() -> dict, reload() -> dict,
drain(grace_s), resume(), trace(start, path) -> dict. Never imports models or
store. The socket gets [control] mode (default 0600) and group before it
listens: bound at a temporary path, chmod/chown'd, then renamed into place.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import os
import socket
import stat
import threading
from pathlib import Path
from typing import Any

from grpclib.const import Status
from grpclib.exceptions import GRPCError
from grpclib.server import Server, Stream

from deltafind.control import control_pb2 as pb
from deltafind.control.control_grpc import ControlBase
from deltafind.errors import ConfigError, DeltafindError, RequestError
from deltafind.log import get_logger

log = get_logger(__name__)


def grpc_status(e: Exception) -> GRPCError:
    """The one map from our errors to grpclib statuses."""
    if isinstance(e, (ConfigError, RequestError)):
        return GRPCError(Status.INVALID_ARGUMENT, str(e))
    if isinstance(e, DeltafindError):
        return GRPCError(Status.FAILED_PRECONDITION, str(e))
    if isinstance(e, TimeoutError):
        return GRPCError(Status.DEADLINE_EXCEEDED, str(e) or "timed out")
    return GRPCError(Status.INTERNAL, f"{type(e).__name__}: {e}")


def status_reply(d: dict[str, Any]) -> pb.StatusReply:
    return pb.StatusReply(**{k: v for k, v in d.items() if v is not None})


class ControlService(ControlBase):
    def __init__(self, target: Any) -> None:
        self.target = target

    async def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
        except Exception as e:
            raise grpc_status(e) from None

    async def Status(self, stream: Stream[pb.StatusRequest, pb.StatusReply]) -> None:
        await stream.recv_message()
        await stream.send_message(status_reply(await self._call(self.target.status)))

    async def Reload(self, stream: Stream[pb.ReloadRequest, pb.ReloadReply]) -> None:
        await stream.recv_message()
        r = await self._call(self.target.reload)
        await stream.send_message(
            pb.ReloadReply(
                ok=r["ok"],
                message=r["message"],
                applied=r["applied"],
                restart_needed=r["restart_needed"],
            )
        )

    async def Drain(self, stream: Stream[pb.DrainRequest, pb.StatusReply]) -> None:
        req = await stream.recv_message()
        assert req is not None
        await self._call(self.target.drain, req.grace_s or None)
        await stream.send_message(status_reply(await self._call(self.target.status)))

    async def Resume(self, stream: Stream[pb.ResumeRequest, pb.StatusReply]) -> None:
        await stream.recv_message()
        await self._call(self.target.resume)
        await stream.send_message(status_reply(await self._call(self.target.status)))

    async def Trace(self, stream: Stream[pb.TraceRequest, pb.TraceReply]) -> None:
        req = await stream.recv_message()
        assert req is not None
        r = await self._call(
            self.target.trace, req.action == pb.TraceRequest.START, req.path or None
        )
        await stream.send_message(pb.TraceReply(active=r["active"], path=r["path"]))


def bind_socket(path: Path, mode: int, group: str | None) -> socket.socket:
    """A listening-ready Unix socket at `path` with `mode`/`group` set before anyone can connect."""
    gid = _gid(group)
    if not path.parent.exists():
        make_folder(path.parent, mode, gid)
    else:
        check_folder(path.parent, mode, gid)
    if path.exists() or path.is_symlink():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
            raise DeltafindError(
                f"{path}: another daemon answers on this control socket; stop it or set [control] socket"
            )
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink()  # stale, left by a daemon that died
        finally:
            probe.close()
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(tmp))
    os.chmod(tmp, mode)
    if gid is not None:
        os.chown(tmp, -1, gid)
    os.replace(tmp, path)
    return sock


def _gid(group: str | None) -> int | None:
    if group is None:
        return None
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(f"control.group: no group named {group!r} on this machine") from None


def folder_mode(mode: int) -> int:
    """The socket folder's mode: the owner's rwx, and search (x) for whoever the socket's mode lets in."""
    return 0o700 | (0o050 if mode & 0o060 else 0) | (0o005 if mode & 0o006 else 0)


def make_folder(folder: Path, mode: int, gid: int | None) -> None:
    folder.mkdir(parents=True, mode=0o700)
    if gid is not None:
        os.chown(folder, -1, gid)
    os.chmod(folder, folder_mode(mode))  # mkdir's mode is cut by the umask


def check_folder(folder: Path, mode: int, gid: int | None) -> None:
    """Warn when a folder we did not make keeps out the group (or others) that `mode` lets in."""
    st = folder.stat()
    need = folder_mode(mode) & 0o055
    group_ok = (
        not need & 0o050
        or (st.st_mode & 0o010 and (gid is None or st.st_gid == gid))
        or st.st_mode & 0o001
    )
    other_ok = not need & 0o005 or st.st_mode & 0o001
    if not (group_ok and other_ok):
        log.warning(
            "control_folder_closed",
            folder=str(folder),
            folder_mode=oct(stat.S_IMODE(st.st_mode)),
            folder_gid=st.st_gid,
            socket_mode=oct(mode),
            group_gid=gid,
            fix="chgrp the folder to the socket's group and chmod g+x (or o+x) it, or set [control] socket elsewhere",
        )


class ControlServer:
    """grpclib on its own thread and event loop (signal handlers stay gunicorn's)."""

    def __init__(
        self, target: Any, path: Path, mode: int = 0o600, group: str | None = None
    ) -> None:
        self.target, self.path, self.mode, self.group = target, Path(path), mode, group
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: Server | None = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None

    def start(self) -> None:
        self._sock = bind_socket(self.path, self.mode, self.group)
        started = threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            loop = self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(loop)
            self._server = Server([ControlService(self.target)])
            try:
                loop.run_until_complete(self._server.start(sock=self._sock))
            except BaseException as e:
                errors.append(e)
                return
            finally:
                started.set()
            log.info("control_listening", socket=str(self.path), mode=oct(self.mode))
            try:
                loop.run_until_complete(self._server.wait_closed())
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="deltafind-control", daemon=True)
        self._thread.start()
        started.wait(10)
        if errors:
            raise errors[0]

    def stop(self) -> None:
        if self._loop is not None and self._server is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._server.close)
        if self._thread is not None:
            self._thread.join(5)
        with contextlib.suppress(OSError):
            self.path.unlink(missing_ok=True)
