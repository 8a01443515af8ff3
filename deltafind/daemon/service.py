"""`deltafind install-service`: the systemd unit or launchd plist, with this install's paths.

The unit is `systemd/deltafind.service` with ExecStart/ExecReload pointing at
this environment's scripts and ReadWritePaths naming the configured store and
drives. launchd expands neither ~ nor $HOME, so the plist is written with
plistlib and absolute paths.
"""

from __future__ import annotations

import argparse
import os
import plistlib
import shlex
import sys
from pathlib import Path
from typing import Any

from deltafind.errors import ConfigError

LABEL = "dev.deltafind.daemon"
_UNIT_TEMPLATE = Path(__file__).resolve().parents[2] / "systemd" / "deltafind.service"


def _scripts() -> tuple[Path, Path]:
    bin_dir = Path(sys.executable).parent
    return bin_dir / "deltafind", bin_dir / "deltafinctl"


def _paths(config: Path | None) -> tuple[list[Path], list[Path]]:
    """(read-write paths: store and drives, read-only: the config's folder) from the config."""
    from deltafind.config import load_settings

    s = load_settings(config)
    rw = [Path(s.model.store).expanduser().resolve()] if s.model.store else []
    rw += [Path(d.path).expanduser().resolve() for d in s.drives]
    ro = [config.resolve().parent] if config else []
    return list(dict.fromkeys(rw)), ro


def render_unit(config: Path | None, user: bool = False) -> str:
    exe, ctl = _scripts()
    cfg = f" --config {shlex.quote(str(config.resolve()))}" if config else ""
    rw, ro = _paths(config)
    if not _UNIT_TEMPLATE.is_file():
        raise ConfigError(
            f"the unit template {_UNIT_TEMPLATE} is missing from this install; reinstall deltafind"
        )
    out = []
    for line in _UNIT_TEMPLATE.read_text().splitlines():
        key = line.split("=", 1)[0]
        if key == "ExecStart":
            line = f"ExecStart={exe} serve{cfg}"
        elif key == "ExecReload":
            line = f"ExecReload={ctl}{cfg} reload"
        elif key == "ReadWritePaths":
            line = (
                "ReadWritePaths=" + " ".join(["/var/lib/deltafind", *map(str, rw)])
                if not user
                else "ReadWritePaths=" + " ".join(map(str, rw))
                if rw
                else ""
            )
        elif key == "ReadOnlyPaths":
            line = (
                "ReadOnlyPaths=" + " ".join(map(str, ro or [Path("/etc/deltafind")]))
                if not user
                else ""
            )
        elif user and key in (
            "User",
            "Group",
            "StateDirectory",
            "WorkingDirectory",
            "CapabilityBoundingSet",
            "ProtectKernelTunables",
            "ProtectKernelModules",
            "ProtectKernelLogs",
            "ProtectControlGroups",
            "ProtectClock",
            "ProtectHostname",
            "ProtectHome",
            "LimitMEMLOCK",
        ):
            continue  # a user manager cannot drop to another user or set these
        elif user and key == "WantedBy":
            line = "WantedBy=default.target"
        elif user and line.startswith("#   useradd"):
            continue
        out.append(line)
    return "\n".join(out) + "\n"


HIDDEN = {
    "ProtectHome=yes": ("/home", "/root", "/run/user"),
    "PrivateTmp=yes": ("/tmp", "/var/tmp"),
}


def hidden_paths(unit: str, config: Path | None) -> list[str]:
    """Warnings for the venv, store, drives or config that the unit's sandboxing would hide from the service."""
    rw, ro = _paths(config)
    named = [
        ("the venv", Path(sys.prefix).resolve()),
        ("deltafind's scripts", _scripts()[0].parent.resolve()),
    ]
    named += [("the store or a drive", p) for p in rw] + [("the config folder", p) for p in ro]
    out = []
    lines = {line.strip() for line in unit.splitlines()}
    for setting, roots in HIDDEN.items():
        if setting not in lines:
            continue
        for what, path in named:
            root = next((r for r in roots if path == Path(r) or Path(r) in path.parents), None)
            if root is not None:
                out.append(
                    f"{setting} hides {root} from the service, so {what} ({path}) will not be found; move it "
                    f"(e.g. under /opt or /var/lib/deltafind) or relax {setting.split('=')[0]}= in the unit"
                )
    return list(dict.fromkeys(out))


def render_plist(config: Path | None, user: bool = True) -> bytes:
    exe, _ = _scripts()
    home = Path.home()
    logs = home / "Library" / "Logs" / "deltafind" if user else Path("/Library/Logs/deltafind")
    args = [str(exe), "serve", *(["--config", str(config.resolve())] if config else [])]
    plist: dict[str, Any] = {
        "Label": LABEL,
        "ProgramArguments": args,
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},
        "ProcessType": "Interactive",
        "ExitTimeOut": 60,  # longer than [server] graceful_timeout_s: streams drain first
        "StandardOutPath": str(logs / "deltafind.out.log"),
        "StandardErrorPath": str(logs / "deltafind.err.log"),
        "WorkingDirectory": str(home if user else Path("/var/lib/deltafind")),
        "EnvironmentVariables": {"PYTHONUNBUFFERED": "1", "PATH": f"{exe.parent}:/usr/bin:/bin"},
    }
    return plistlib.dumps(plist)


def target_path(platform: str, user: bool) -> Path:
    if platform == "darwin":
        return (
            Path.home() / "Library" / "LaunchAgents" if user else Path("/Library/LaunchDaemons")
        ) / f"{LABEL}.plist"
    if user:
        base = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
        return base / "systemd" / "user" / "deltafind.service"
    return Path("/etc/systemd/system/deltafind.service")


def install(args: argparse.Namespace) -> tuple[str, Path]:
    platform = args.platform or ("darwin" if sys.platform == "darwin" else "linux")
    from deltafind.config import config_path

    config = config_path(args.config or None)
    path = target_path(platform, args.user)
    if args.output:
        path = Path(args.output) / path.name
    if platform == "darwin":
        data = render_plist(config, args.user)
        text = data.decode()
    else:
        text = render_unit(config, args.user)
        data = text.encode()
        for warning in hidden_paths(text, config):
            print(f"deltafind: warning: {warning}", file=sys.stderr)
    if not args.print_only:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        if platform == "darwin" and not args.output:
            (Path.home() / "Library" / "Logs" / "deltafind").mkdir(parents=True, exist_ok=True)
        hint = (
            f"launchctl load -w {path}"
            if platform == "darwin"
            else f"systemctl {'--user ' if args.user else ''}daemon-reload && systemctl {'--user ' if args.user else ''}enable --now deltafind"
        )
        print(f"next: {hint}", file=sys.stderr)
    return text, path
