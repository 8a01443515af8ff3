"""The README's torchrun example, run as written: one `torchrun` per machine (here three on loopback),
the coordinator `deltafind serve` at node_rank 0, two `deltafind node` at node_ranks 1 and 2, each
taking its rank, world size and the group's address from torchrun's variables (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT; the configs leave them unset). The openai SDK's completions from it must
be those of one machine (a daemon without [cluster]), greedy and seeded sampling; and again after
node 2's machine lost it and it was restarted without torchrun (the coordinator takes it back)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.cluster.harness import free_port, make_store
from tests.e2e.daemon_fixtures import Daemon

openai = pytest.importorskip("openai")
TORCHRUN = Path(sys.executable).with_name("torchrun")
deltafind = shutil.which("deltafind") or str(TORCHRUN.with_name("deltafind"))  # $(which deltafind)
ASKS = [
    {"prompt": "The cluster", "max_tokens": 12, "temperature": 0},
    {"prompt": "Several machines", "max_tokens": 12, "temperature": 0.9, "top_p": 0.95, "seed": 7},
]


def completions(url: str) -> list[str]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    return [client.completions.create(model="test-model", **ask).choices[0].text for ask in ASKS]


def torchrun(node_rank: int, port: int, *command: str, cwd: Path) -> subprocess.Popen[bytes]:
    """`torchrun --nnodes 3 --nproc-per-node 1 --node-rank R --master-addr A --master-port P $(which deltafind) ...`"""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    with open(cwd / f"torchrun{node_rank}.log", "w") as log:
        return subprocess.Popen(
            [
                str(TORCHRUN),
                "--nnodes",
                "3",
                "--nproc-per-node",
                "1",
                "--node-rank",
                str(node_rank),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                str(port),
                deltafind,
                *command,
            ],
            cwd=cwd,
            env={**env, "OMP_NUM_THREADS": "1"},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # its own process group: the worker dies with it if the test fails


def node2(where: Path) -> dict:
    status = subprocess.run(
        [
            str(TORCHRUN.with_name("deltafinctl")),
            "--socket",
            str(where / "ctl.sock"),
            "status",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(status.stdout)["snapshot"]["store"]["nodes"][1]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def test_torchrun_example_serves_the_tokens_of_one_machine(tmp_path: Path) -> None:
    store = make_store("qwen3_moe", tmp_path)
    one = Daemon(store, '[draft]\nmode = "off"\n')
    try:
        want = completions(one.start(timeout=240).url)
        assert one.stop() == 0
    finally:
        one.cleanup()

    http = free_port()
    (tmp_path / "coordinator.toml").write_text(
        f'[model]\nstore = "{store}"\nname = "test-model"\n\n[server]\nport = {http}\n\n'
        f'[control]\nsocket = "{tmp_path / "ctl.sock"}"\n\n[draft]\nmode = "off"\n\n'
        '[cluster]\nrole = "coordinator"\njoin_timeout_s = 120\n'
    )
    (tmp_path / "node.toml").write_text(
        f'[model]\nstore = "{store}"\n\n[cluster]\nrole = "expert"\njoin_timeout_s = 120\n'
    )
    port = free_port()
    procs = [torchrun(r, port, "node", "--config", "node.toml", cwd=tmp_path) for r in (1, 2)]
    procs.append(torchrun(0, port, "serve", "--config", "coordinator.toml", cwd=tmp_path))
    try:
        deadline = time.monotonic() + 240
        while not healthy(f"http://127.0.0.1:{http}/health"):
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, (
                tmp_path / "torchrun0.log"
            ).read_text()[-4000:]
            time.sleep(0.5)
        got = completions(f"http://127.0.0.1:{http}")

        os.killpg(procs[1].pid, signal.SIGKILL)  # node 2's machine loses its torchrun and node
        procs[1].wait(timeout=30)
        # Restarted without torchrun (its static rendezvous formed the group once), with the variables torchrun gave it.
        restarted = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "RANK": "2",
            "WORLD_SIZE": "3",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        with open(tmp_path / "node2-restarted.log", "w") as log:
            procs[1] = subprocess.Popen(
                [deltafind, "node", "--config", "node.toml"],
                cwd=tmp_path,
                env=restarted,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 240
        while node2(tmp_path)["joins"] < 2:
            assert procs[1].poll() is None and time.monotonic() < deadline, (
                tmp_path / "node2-restarted.log"
            ).read_text()
            time.sleep(0.5)
        again = completions(f"http://127.0.0.1:{http}")
        assert (
            node2(tmp_path)["alive"] and node2(tmp_path)["layers"] > 0
        )  # its experts computed on it again

        procs[2].send_signal(
            signal.SIGTERM
        )  # the coordinator's torchrun stops its daemon, which stops the nodes
        assert [p.wait(timeout=90) for p in procs[:2]] == [0, 0], (
            tmp_path / "torchrun1.log"
        ).read_text()[-4000:]
    finally:
        for p in procs:  # torchrun and its worker, if a failure left them running
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
    assert got == want and again == want
    log = (tmp_path / "torchrun0.log").read_text()
    assert (
        '"world_size": 3' in log and '"cluster_ready"' in log
    )  # the group torchrun described, not a single process
