"""The daemon's subcommands: `deltafind serve` (also `deltafind` alone) and `install-service`.

Settings are built once here (file, DELTAFIND_* variables, then flags); a bad
config exits 2 and a missing store 3 before gunicorn starts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from deltafind.errors import StoreError


def add_subcommands(sub: Any) -> None:
    p = sub.add_parser(
        "serve", help="run the daemon: the OpenAI API and the control socket (the default command)"
    )
    add_serve_options(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser(
        "install-service",
        help="write the systemd unit (Linux) or launchd plist (macOS) for this install",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="config the service runs with (default /etc/deltafind/deltafind.toml)",
    )
    p.add_argument(
        "--user",
        action="store_true",
        help="a per-user service (systemd --user, a LaunchAgent) instead of system-wide",
    )
    p.add_argument(
        "--platform",
        choices=["linux", "darwin"],
        help="write for this platform (default: this machine's)",
    )
    p.add_argument(
        "--output", metavar="DIR", help="write into DIR instead of the platform's service folder"
    )
    p.add_argument(
        "--print",
        dest="print_only",
        action="store_true",
        help="print the file instead of writing it",
    )
    p.set_defaults(func=cmd_install_service)


def add_serve_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        metavar="FILE",
        help="TOML config (default /etc/deltafind/deltafind.toml when it exists)",
    )
    p.add_argument("--store", metavar="DIR", help="store to serve (overrides [model] store)")
    p.add_argument("--host", help="HTTP address (overrides [server] host)")
    p.add_argument("--server-port", type=int, help="HTTP port (overrides [server] port)")
    p.add_argument("--socket", metavar="PATH", help="control socket (overrides [control] socket)")


def overrides_from(args: argparse.Namespace) -> dict[str, Any]:
    """The flags by their settings' Python names (docs/configuration.md)."""
    from deltafind.config.schema import by_section

    return by_section(
        {k: getattr(args, k, None) for k in ("store", "host", "server_port", "socket")}
    )


def cmd_serve(args: argparse.Namespace) -> int:
    from deltafind.config import config_path, load_settings
    from deltafind.log import configure_logging

    overrides = overrides_from(args)
    config = config_path(getattr(args, "config", None) or None)
    settings = load_settings(config, overrides)
    from deltafind.compose import store_dir

    check_store_access(store_dir(settings))
    configure_logging(settings.logging.level, settings.logging.format)
    from deltafind.daemon.app import DaemonApp

    DaemonApp(settings, config, overrides).run()
    return 0


def check_store_access(store: Path) -> None:
    """A store this user can read, or a StoreError naming the path and the permission missing."""
    import os

    from deltafind.store.manifest import MANIFEST_NAME, no_permission

    manifest = store / MANIFEST_NAME
    try:
        found = manifest.is_file()
    except PermissionError:
        folder = next(
            (
                p
                for p in reversed([store, *store.parents])
                if p.exists() and not os.access(p, os.X_OK)
            ),
            store,
        )
        raise StoreError(no_permission(folder, "search (x)")) from None
    if not found:
        raise StoreError(
            f"{store}: not a deltafind store (no manifest.json); create it with `deltafind setup`"
        )
    if not os.access(manifest, os.R_OK):
        raise StoreError(no_permission(manifest, "read"))


def cmd_install_service(args: argparse.Namespace) -> int:
    from deltafind.daemon.service import install

    text, path = install(args)
    if args.print_only:
        sys.stdout.write(text)
    else:
        print(f"wrote {path}")
    return 0
