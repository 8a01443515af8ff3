"""The control client used by deltafinctl: one call per command over the Unix socket."""

from __future__ import annotations

import asyncio
import getpass
import grp
import json
import os
import pwd
import stat
from pathlib import Path
from typing import Any

from google.protobuf.json_format import MessageToDict
from grpclib.client import Channel
from grpclib.exceptions import GRPCError, StreamTerminatedError

from deltafind.control import control_pb2 as pb
from deltafind.control.control_grpc import ControlStub
from deltafind.errors import DeltafindError


class NoDaemon(DeltafindError):
    """Nothing answers on the control socket."""

    exit_code = 1


class ControlFailed(DeltafindError):
    exit_code = 1


class NoPermission(DeltafindError):
    """The socket, or a folder on its path, does not let this user in (systemctl's exit code 4)."""

    exit_code = 4


def _name(lookup: Any, num: int) -> str:
    """A user's or group's name (`pwd.getpwuid`, `grp.getgrgid`), or its number when it has none."""
    try:
        return str(lookup(num)[0])
    except KeyError:
        return str(num)


def _who() -> str:
    names = [_name(grp.getgrgid, gid) for gid in sorted(set(os.getgroups()))]
    return f"user {getpass.getuser()} (groups: {', '.join(names) or 'none'})"


def _owner(path: Path) -> str:
    st = path.stat()
    return f"owner {_name(pwd.getpwuid, st.st_uid)}:{_name(grp.getgrgid, st.st_gid)}, mode {stat.S_IMODE(st.st_mode):04o}"


def permission_error(path: Path) -> NoPermission:
    """Say which folder or socket keeps this user out, which permission is missing, and the fix."""
    for folder in reversed(path.parents):
        if folder.exists() and not os.access(folder, os.X_OK):
            return NoPermission(
                f"cannot reach the control socket {path}: no search (x) permission on the folder {folder} "
                f"({_owner(folder)}) for {_who()}; join the folder's group, or run deltafinctl as the "
                "daemon's user (or with sudo)"
            )
    try:
        owner = _owner(path)
    except OSError:
        owner = "owner unknown"
    return NoPermission(
        f"cannot connect to the control socket {path}: connecting needs write (w) permission on it "
        f"({owner}) for {_who()}; join the socket's group (set [control] group and mode = \"0660\") "
        "or run deltafinctl as the daemon's user (or with sudo)"
    )


async def _call(socket_path: Path, method: str, request: Any, timeout: float) -> Any:
    channel = Channel(path=str(socket_path))
    try:
        return await getattr(ControlStub(channel), method)(request, timeout=timeout)
    finally:
        channel.close()


def call(
    socket_path: Path | str, method: str, request: Any, timeout: float = 30.0
) -> dict[str, Any]:
    """Run one RPC; the reply as a dict (every field, defaults included)."""
    path = Path(socket_path)
    try:
        path.stat()
    except PermissionError:
        raise permission_error(path) from None
    except OSError:  # missing, or a path through a file
        raise NoDaemon(
            f"no daemon running: no control socket at {path} (is deltafind running? see [control] socket or --socket)"
        ) from None
    try:
        reply = asyncio.run(_call(path, method, request, timeout))
    except PermissionError:
        raise permission_error(path) from None
    except (ConnectionRefusedError, FileNotFoundError, StreamTerminatedError, OSError) as e:
        raise NoDaemon(
            f"no daemon running on {path}: {e.strerror if isinstance(e, OSError) and e.strerror else e}"
        ) from None
    except GRPCError as e:
        raise ControlFailed(f"{method.lower()} failed: {e.message}") from None
    except asyncio.TimeoutError:
        raise ControlFailed(f"{method.lower()} timed out after {timeout:.0f} s") from None
    # the proto has no 64-bit ints, so every number stays a number
    return MessageToDict(
        reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def status(path: Path | str) -> dict[str, Any]:
    """The daemon's status; "snapshot" holds the engine's and the store's whole snapshots."""
    reply = call(path, "Status", pb.StatusRequest())
    reply["snapshot"] = json.loads(reply.pop("snapshot_json", "") or "{}")
    return reply
