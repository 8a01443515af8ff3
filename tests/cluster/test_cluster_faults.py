"""Faults on a loopback cluster: a node killed mid-request (the real daemon, the openai SDK), a node
that stalls past `[cluster] timeout_s` and a node whose read fails its checksum fail the requests in
flight with a clear error, never a wrong token; a live replica keeps serving, a node that reported
an error keeps answering, and status and /health say which node is down; a restarted node is taken
back by the running coordinator and serves its experts again, the same tokens."""

from __future__ import annotations

import json
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from deltafind.api import Model
from deltafind.cluster.wire import ClusterError
from deltafind.config import load_settings
from deltafind.store.manifest import Manifest, pack_name
from tests.cluster.harness import (
    cluster_settings,
    free_port,
    make_store,
    nodes,
    reaped,
    slow_node_config,
    start_node,
)
from tests.e2e.daemon_fixtures import Daemon

openai = pytest.importorskip("openai")
PROMPT = "The cluster"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_store("qwen3_moe", tmp_path_factory.mktemp("faults"))


def wait_for(condition: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_killed_node_fails_its_request_and_the_replica_serves_on(store: Path) -> None:
    port = free_port()
    # Every expert on both nodes (hot_replicas = 1); slow drives keep a request running while a node dies.
    with nodes(store, 2, port, config=slow_node_config(store, 0.5)) as procs:
        daemon = Daemon(
            store,
            '[draft]\nmode = "off"\n\n[cluster]\nrole = "coordinator"\nworld_size = 3\n'
            f"port = {port}\ntimeout_s = 20\njoin_timeout_s = 120\nhot_replicas = 1.0\n",
        )
        try:
            daemon.start(timeout=240)
            client = openai.OpenAI(
                base_url=daemon.url + "/v1", api_key="none", max_retries=0, timeout=120
            )
            first = client.completions.create(
                model="test-model", prompt=PROMPT, max_tokens=6, temperature=0
            )
            assert first.choices[0].text
            status = json.loads(daemon.ctl("status", "--json").stdout)
            nodes_before = status["snapshot"]["store"]["nodes"]
            assert [n["alive"] for n in nodes_before] == [True, True] and all(
                n["layers"] for n in nodes_before
            )

            stream = client.completions.create(
                model="test-model",
                prompt=PROMPT + " again",
                max_tokens=400,
                temperature=0,
                stream=True,
            )
            with pytest.raises(openai.APIError) as failed:
                for i, _ in enumerate(stream):
                    if i == 1:
                        procs[1].send_signal(signal.SIGKILL)  # node 2 dies mid-request
            assert "node 2" in str(failed.value.message or failed.value), failed.value

            again = client.completions.create(
                model="test-model", prompt=PROMPT, max_tokens=6, temperature=0
            )
            assert (
                again.choices[0].text == first.choices[0].text
            )  # node 1's copies: the same tokens
            code, body = daemon.get("/health")
            assert code == 200 and json.loads(body) == {
                "status": "degraded",
                "model": "test-model",
                "nodes_down": [2],
            }
            text = daemon.ctl("status").stdout
            assert "node 1     ok" in text and "node 2     DOWN" in text and "last error" in text, (
                text
            )

            with reaped(
                [start_node(store, 2, 3, port, config=slow_node_config(store, 0.5))]
            ) as back:  # node 2 restarted
                wait_for(lambda: json.loads(daemon.get("/health")[1])["status"] == "ready", 120)
                assert "node 2     ok" in daemon.ctl("status").stdout
                before = json.loads(daemon.ctl("status", "--json").stdout)["snapshot"]["store"][
                    "nodes"
                ][1]["layers"]
                after = client.completions.create(
                    model="test-model", prompt=PROMPT, max_tokens=6, temperature=0
                )
                assert after.choices[0].text == first.choices[0].text
                node2 = json.loads(daemon.ctl("status", "--json").stdout)["snapshot"]["store"][
                    "nodes"
                ][1]
                assert (
                    node2["alive"] and node2["joins"] == 2 and node2["layers"] > before
                )  # it computes its share again
                assert daemon.stop() == 0
                assert [procs[0].wait(timeout=60), back[0].wait(timeout=60)] == [
                    0,
                    0,
                ]  # stopped by the coordinator
        finally:
            daemon.cleanup()


def test_stalled_node_times_out_and_experts_without_a_copy_fail_clearly(store: Path) -> None:
    port = free_port()
    with nodes(store, 2, port) as procs, reaped([]) as back:
        settings = load_settings(
            None,
            {
                "model": {"store": str(store)},
                "draft": {"mode": "off"},
                "cluster": cluster_settings(2, port, timeout_s=2.0),
            },
        )
        model = Model.open(store, settings=settings)
        try:
            ids = model.tokenizer.encode(PROMPT)
            want = model.generate(ids, max_new_tokens=4)
            procs[1].send_signal(signal.SIGSTOP)  # node 2 stalls
            t0 = time.monotonic()
            with pytest.raises(ClusterError, match=r"node 2: no answer within 2 s"):
                model.generate(ids, max_new_tokens=4)
            assert time.monotonic() - t0 < 30
            with pytest.raises(
                ClusterError, match=r"has no live copy \(node 2: no answer within 2 s"
            ):
                model.generate(ids, max_new_tokens=4)  # node 1 holds the other half only
            nodes_now = {n["rank"]: n for n in model.snapshot()["nodes"]}
            assert (
                nodes_now[1]["alive"]
                and not nodes_now[2]["alive"]
                and "no answer" in nodes_now[2]["last_error"]
            )

            procs[1].send_signal(
                signal.SIGCONT
            )  # the stalled node finds its group closed and exits 1 (systemd restarts it)
            assert procs[1].wait(timeout=60) == 1
            back.append(
                start_node(store, 2, 3, port)
            )  # restarted: the running coordinator takes it back
            wait_for(lambda: model.snapshot()["nodes"][1]["alive"], 120)
            node2 = model.snapshot()["nodes"][1]
            assert node2["joins"] == 2
            assert (
                model.generate(ids, max_new_tokens=4) == want
            )  # node 2's experts (no replica) served by it again
            assert model.snapshot()["nodes"][1]["layers"] > node2["layers"]
        finally:
            model.close()
        assert back[0].wait(timeout=60) == 0  # stopped by the coordinator


def test_node_error_fails_the_request_with_its_cause_and_the_node_stays_up(
    store: Path, tmp_path: Path
) -> None:
    bad = tmp_path / "bad-store"
    shutil.copytree(store, bad)
    manifest = Manifest.load(bad)
    with open(
        bad / "drive0" / pack_name(0), "r+b"
    ) as f:  # every routed record of node 2's copy fails its checksum
        for r in manifest.experts:
            if r.layer == 1:
                f.seek(r.offset)
                f.write(bytes(b ^ 0xFF for b in f.read(64)))
                f.seek(r.offset)
    port = free_port()
    with reaped([start_node(store, 1, 3, port), start_node(bad, 2, 3, port)]) as procs:
        settings = load_settings(
            None,
            {
                "model": {"store": str(store)},
                "draft": {"mode": "off"},
                "cluster": cluster_settings(2, port),
            },
        )
        model = Model.open(store, settings=settings)
        try:
            for _ in range(2):  # the node answers every request, with the read's error each time
                with pytest.raises(
                    ClusterError, match=r"node 2: CorruptExpertError: .*expert \d+ of layer 1"
                ):
                    model.generate(model.tokenizer.encode(PROMPT), max_new_tokens=4)
            node2 = model.snapshot()["nodes"][1]
            assert node2["alive"] and "CorruptExpertError" in node2["last_error"]
        finally:
            model.close()
        assert [p.wait(timeout=60) for p in procs] == [0, 0]
