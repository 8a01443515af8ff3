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
    return dict(
        line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#")
    )


def _config(tmp_path: Path) -> Path:
    cfg = tmp_path / "deltafind.toml"
    cfg.write_text(
        f'[model]\nstore = "{tmp_path / "store"}"\n[[drives]]\npath = "{tmp_path / "nvme1"}"\n'
    )
    return cfg


def test_unit_has_notify_reload_memlock_and_hardening(tmp_path: Path) -> None:
    keys = _unit_keys(render_unit(_config(tmp_path)))
    assert keys["Type"] == "notify" and keys["NotifyAccess"] == "all"
    assert (
        keys["ExecReload"].endswith(f"--config {tmp_path / 'deltafind.toml'} reload")
        and "deltafinctl" in keys["ExecReload"]
    )
    assert keys["ExecStart"].startswith(str(Path(sys.executable).parent / "deltafind") + " serve")
    assert keys["LimitMEMLOCK"] == "infinity" and keys["User"] == "deltafind"
    assert (
        keys["NoNewPrivileges"] == "yes"
        and keys["ProtectSystem"] == "strict"
        and keys["PrivateTmp"] == "yes"
    )
    assert (
        str(tmp_path / "store") in keys["ReadWritePaths"]
        and str(tmp_path / "nvme1") in keys["ReadWritePaths"]
    )
    assert "MemoryDenyWriteExecute" not in keys and "PrivateDevices" not in keys
    user = _unit_keys(render_unit(_config(tmp_path), user=True))
    assert "User" not in user and user["WantedBy"] == "default.target"


@pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze is not installed (Debian: apt-get install systemd)",
)
@pytest.mark.parametrize("user", [False, True])
def test_systemd_analyze_verifies_the_installed_unit(tmp_path: Path, user: bool) -> None:
    args = argparse.Namespace(
        platform="linux",
        config=str(_config(tmp_path)),
        user=user,
        output=str(tmp_path / "out"),
        print_only=False,
    )
    _, path = install(args)
    runtime = tmp_path / "run"  # a user manager needs a runtime directory
    runtime.mkdir(mode=0o700)
    proc = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *(["--user"] if user else []), str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)},
    )
    problems = [ln for ln in proc.stderr.splitlines() if "deltafind.service" in ln]
    assert proc.returncode == 0 and not problems, proc.stderr


def test_plists_parse_with_the_launchd_keys(tmp_path: Path) -> None:
    checked_in = plistlib.loads((ROOT / "launchd" / "dev.deltafind.daemon.plist").read_bytes())
    made = plistlib.loads(render_plist(_config(tmp_path), user=True))
    for plist in (checked_in, made):
        assert plist["Label"] == "dev.deltafind.daemon" and plist["RunAtLoad"] is True
        assert (
            plist["KeepAlive"] == {"SuccessfulExit": False}
            and plist["ProgramArguments"][1] == "serve"
        )
        assert plist["StandardErrorPath"].startswith("/") and plist["ExitTimeOut"] > 30
    assert made["ProgramArguments"][-1] == str(tmp_path / "deltafind.toml")
    assert "~" not in "".join(map(str, made.values()))


def test_make_proto_reproduces_the_committed_stubs(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools is in the test extra (make dev)")
    (tmp_path / "deltafind" / "control").mkdir(parents=True)
    shutil.copy(
        ROOT / "deltafind" / "control" / "control.proto", tmp_path / "deltafind" / "control"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I",
            ".",
            "--python_out=.",
            "--pyi_out=.",
            "--grpclib_python_out=.",
            "deltafind/control/control.proto",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        # grpclib's protoc plugin is a script beside this interpreter; CI does not activate the venv
        env={
            **os.environ,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        },
    )
    assert proc.returncode == 0, proc.stderr
    for name in ("control_pb2.py", "control_pb2.pyi", "control_grpc.py"):
        made = (tmp_path / "deltafind" / "control" / name).read_text()
        assert made == (ROOT / "deltafind" / "control" / name).read_text(), (
            f"{name} is stale: run `make proto`"
        )


# README's architecture, top to bottom: a package imports only packages below its own row (and its own
# package). The top row wires everything, so its members may import each other; so may the bottom row's.
LAYERS = (
    (
        "deltafind.cli",
        "deltafind.setup_cli",
        "deltafind.run_cli",
        "deltafind.daemon",
        "deltafind.api",
        "deltafind.compose",
        "deltafind",
    ),
    ("deltafind.server", "deltafind.control"),
    (
        "deltafind.engine",
        "deltafind.cluster",
    ),  # cluster: a provider over models/store/device, wired by api
    (
        "deltafind.models",
        "deltafind.device",
        "deltafind.importer",
    ),  # importer: writes what store reads
    ("deltafind.store",),
    (
        "deltafind.tokenizer",
        "deltafind.config",
        "deltafind.errors",
        "deltafind.log",
        "deltafind.provider",
    ),
)
# of the store, models see only the block-format tags the provider contract carries (store/quant.py)
NARROWER = {("deltafind.models", "deltafind.store"): ("deltafind.store.quant",)}


def _modules() -> dict[str, tuple[Path, bool]]:
    mods = {}
    for path in (ROOT / "deltafind").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = (
            path,
            parts[-1] == "__init__",
        )
    return mods


def import_graph() -> dict[str, set[str]]:
    """module -> the deltafind modules it imports anywhere in its file (relative imports resolved)."""
    mods, graph = _modules(), {}

    def known(name: str) -> str:
        while name not in mods:
            name = name.rpartition(".")[0]
        return name

    for name, (path, is_pkg) in mods.items():
        package, edges = name if is_pkg else name.rpartition(".")[0], set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {known(a.name) for a in node.names if a.name.startswith("deltafind")}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(
                        [
                            *package.split(".")[: len(package.split(".")) - node.level + 1],
                            *filter(None, [node.module]),
                        ]
                    )
                if base.startswith("deltafind"):
                    edges |= {
                        f"{base}.{a.name}" if f"{base}.{a.name}" in mods else known(base)
                        for a in node.names
                    }
        graph[name] = edges - {name}
    return graph


def _layer(module: str) -> tuple[int, str]:
    package = ".".join(module.split(".")[:2])
    return next(((i, package) for i, row in enumerate(LAYERS) if package in row), (-1, package))


def upward_edges(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in graph.items():
        (i, a) = _layer(src)
        for dst in targets:
            (j, b) = _layer(dst)
            narrow = NARROWER.get((a, b))
            if a != b and (
                j < i
                or (j == i and i not in (0, len(LAYERS) - 1))
                or (narrow and not dst.startswith(narrow))
            ):
                bad.append(f"{src} imports {dst}")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while not comp or v not in comp:
                comp.add(stack.pop())
            if len(comp) > 1:
                found.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_imports_point_down() -> None:
    graph = import_graph()
    assert [m for m in graph if _layer(m)[0] < 0] == [], "a new package: place it in LAYERS"
    assert upward_edges(graph) == []


def test_no_import_cycle_between_modules() -> None:
    assert cycles(import_graph()) == []
