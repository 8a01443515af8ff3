"""Service files (systemd unit, launchd plist), the committed control stubs, and import direction."""

from __future__ import annotations

import argparse
import ast
import os
import plistlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deltafind.daemon.service import install, render_plist, render_unit

ROOT = Path(__file__).resolve().parents[2]


def _unit_keys(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#"))


def _config(tmp_path: Path) -> Path:
    cfg = tmp_path / "deltafind.toml"
    cfg.write_text(f'[model]\nstore = "{tmp_path / "store"}"\n[[drives]]\npath = "{tmp_path / "nvme1"}"\n')
    return cfg


def test_unit_has_notify_reload_memlock_and_hardening(tmp_path: Path) -> None:
    keys = _unit_keys(render_unit(_config(tmp_path)))
    assert keys["Type"] == "notify" and keys["NotifyAccess"] == "all"
    assert keys["ExecReload"].endswith(f"--config {tmp_path / 'deltafind.toml'} reload") and "deltafinctl" in keys["ExecReload"]
    assert keys["ExecStart"].startswith(str(Path(sys.executable).parent / "deltafind") + " serve")
    assert keys["LimitMEMLOCK"] == "infinity" and keys["User"] == "deltafind"
    assert keys["NoNewPrivileges"] == "yes" and keys["ProtectSystem"] == "strict" and keys["PrivateTmp"] == "yes"
    assert str(tmp_path / "store") in keys["ReadWritePaths"] and str(tmp_path / "nvme1") in keys["ReadWritePaths"]
    assert "MemoryDenyWriteExecute" not in keys and "PrivateDevices" not in keys
    user = _unit_keys(render_unit(_config(tmp_path), user=True))
    assert "User" not in user and user["WantedBy"] == "default.target"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed (Debian: apt-get install systemd)")
@pytest.mark.parametrize("user", [False, True])
def test_systemd_analyze_verifies_the_installed_unit(tmp_path: Path, user: bool) -> None:
    args = argparse.Namespace(platform="linux", config=str(_config(tmp_path)), user=user, output=str(tmp_path / "out"),
                              print_only=False)
    _, path = install(args)
    runtime = tmp_path / "run"  # a user manager needs a runtime directory
    runtime.mkdir(mode=0o700)
    proc = subprocess.run(["systemd-analyze", "verify", "--man=no", *(["--user"] if user else []), str(path)],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)})
    problems = [ln for ln in proc.stderr.splitlines() if "deltafind.service" in ln]
    assert proc.returncode == 0 and not problems, proc.stderr


def test_plists_parse_with_the_launchd_keys(tmp_path: Path) -> None:
    checked_in = plistlib.loads((ROOT / "launchd" / "dev.deltafind.daemon.plist").read_bytes())
    made = plistlib.loads(render_plist(_config(tmp_path), user=True))
    for plist in (checked_in, made):
        assert plist["Label"] == "dev.deltafind.daemon" and plist["RunAtLoad"] is True
        assert plist["KeepAlive"] == {"SuccessfulExit": False} and plist["ProgramArguments"][1] == "serve"
        assert plist["StandardErrorPath"].startswith("/") and plist["ExitTimeOut"] > 30
    assert made["ProgramArguments"][-1] == str(tmp_path / "deltafind.toml")
    assert "~" not in "".join(map(str, made.values()))


def test_make_proto_reproduces_the_committed_stubs(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools is in the test extra (make dev)")
    (tmp_path / "deltafind" / "control").mkdir(parents=True)
    shutil.copy(ROOT / "deltafind" / "control" / "control.proto", tmp_path / "deltafind" / "control")
    proc = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", ".", "--python_out=.", "--pyi_out=.",
                           "--grpclib_python_out=.", "deltafind/control/control.proto"], cwd=tmp_path, capture_output=True, text=True,
                          # grpclib's protoc plugin is a script beside this interpreter; CI does not activate the venv
                          env={**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"})
    assert proc.returncode == 0, proc.stderr
    for name in ("control_pb2.py", "control_pb2.pyi", "control_grpc.py"):
        made = (tmp_path / "deltafind" / "control" / name).read_text()
        assert made == (ROOT / "deltafind" / "control" / name).read_text(), f"{name} is stale: run `make proto`"


FORBIDDEN = {
    "deltafind.server": ("deltafind.models", "deltafind.store", "deltafind.daemon", "deltafind.api", "deltafind.control"),
    "deltafind.control": ("deltafind.models", "deltafind.store", "deltafind.daemon", "deltafind.api", "deltafind.server"),
    "deltafind.engine": ("deltafind.server", "deltafind.control", "deltafind.daemon", "deltafind.api", "deltafind.cli"),
}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_down(package: str) -> None:
    for path in (ROOT / Path(*package.split("."))).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert not name.startswith(FORBIDDEN[package]), f"{path.relative_to(ROOT)} imports {name}"
