"""Expert nodes as real processes on loopback (`deltafind node`), and the stores the cluster tests share."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.conftest import deltafind_cmd, make_hf_checkpoint

FAMILIES = ("qwen3_moe", "deepseek_v3", "kimi_k3")
NODE_ENV = {
    "OMP_NUM_THREADS": "1",
    "DELTAFIND_CLUSTER__JOIN_TIMEOUT_S": "120",
    "DELTAFIND_LOGGING__LEVEL": "warning",
}


def make_store(family: str, root: Path) -> Path:
    """A tiny store of `family`: synthetic (qwen3_moe, kimi_k3), or a transformers checkpoint (deepseek_v3, 2 MoE layers)."""
    store = root / f"{family}-store"
    if family == "deepseek_v3":
        setup: tuple[str, ...] = (
            "--from",
            str(make_hf_checkpoint("deepseek_v3", root / "hf", num_hidden_layers=3)),
        )
    else:
        setup = ("--synthetic", family, "--shape", "tiny")
    proc = deltafind_cmd("setup", *setup, "--store", str(store), "--dense-slices", "2", "--quiet")
    assert proc.returncode == 0, proc.stderr
    return store


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_node(
    store: Path,
    rank: int,
    world_size: int,
    port: int,
    env: dict[str, str] | None = None,
    config: Path | None = None,
) -> subprocess.Popen[bytes]:
    exe = Path(sys.executable).with_name("deltafind")
    extra = ["--config", str(config)] if config else []
    with open(
        store.parent / f"node{rank}-{port}.log", "w"
    ) as log:  # a file, so a chatty node never blocks on a pipe
        return subprocess.Popen(
            [
                str(exe),
                "node",
                *extra,
                "--store",
                str(store),
                "--rank",
                str(rank),
                "--world-size",
                str(world_size),
                "--cluster-port",
                str(port),
            ],
            env={**os.environ, **NODE_ENV, **(env or {})},
            stdout=subprocess.DEVNULL,
            stderr=log,
        )


@contextmanager
def nodes(
    store: Path,
    count: int,
    port: int,
    env: dict[str, str] | None = None,
    config: Path | None = None,
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """`count` expert nodes (ranks 1..count) joining a group at `port`; killed if still running at the end."""
    with reaped(
        [start_node(store, r, count + 1, port, env, config) for r in range(1, count + 1)]
    ) as procs:
        yield procs


@contextmanager
def reaped(procs: list[subprocess.Popen[bytes]]) -> Iterator[list[subprocess.Popen[bytes]]]:
    """`procs`, killed at the end if still running (a test that failed half-way leaves no node behind)."""
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)  # a stopped node dies only once it runs
                p.send_signal(signal.SIGKILL)
            p.wait(timeout=30)


def slow_node_config(store: Path, read_mb_s: float) -> Path:
    """A node config whose drive reads at `read_mb_s` and which caches nothing: every token reads."""
    path = store.parent / f"node-{read_mb_s}.toml"
    path.write_text(
        f'[model]\nstore = "{store}"\n\n[[drives]]\npath = "{store / "drive0"}"\nread_mb_s = {read_mb_s}\n\n'
        "[cache]\nexpert_bytes = 0\n"
    )
    return path


def cluster_settings(count: int, port: int, **extra: object) -> dict[str, object]:
    return {
        "role": "coordinator",
        "world_size": count + 1,
        "port": port,
        "join_timeout_s": 120,
        **extra,
    }
