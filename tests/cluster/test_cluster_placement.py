"""Placement of routed experts on nodes: balanced by heat per read rate, replicas on distinct nodes,
a sidecar that round-trips and is refused with the fix when it no longer fits, the CLI that writes it,
and per-node stores (`setup --node R --into DIR`) that hold only their node's experts."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltafind.cluster.placement import (
    SIDECAR,
    Placement,
    check_placement,
    make_placement,
    read_placement,
    write_placement,
)
from deltafind.cluster.runs import routed_counts
from deltafind.errors import StoreError
from deltafind.store.manifest import Manifest
from deltafind.store.reader import PackReader
from tests.cluster.harness import make_store
from tests.conftest import deltafind_cmd


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(1, 40), st.floats(0, 1), st.integers(0, 2**16))
def test_every_expert_placed_and_heat_balanced(
    num_nodes: int, experts: int, hot: float, seed: int
) -> None:
    rng = random.Random(seed)
    heat = {(3, e): rng.random() * 10 for e in range(experts)}
    p = make_placement({3: experts}, num_nodes, heat, None, hot)
    assert set(p.owners) == {(3, e) for e in range(experts)}
    for ranks in p.owners.values():
        assert len(set(ranks)) == len(ranks) and all(1 <= r <= num_nodes for r in ranks)
    replicated = sum(len(r) > 1 for r in p.owners.values())
    assert replicated == (round(hot * experts) if num_nodes > 1 else 0)
    share = [
        sum(heat[k] / len(r) for k, r in p.owners.items() if n in r)
        for n in range(1, num_nodes + 1)
    ]
    # Greedy by heat: no node carries more than the mean plus the hottest single expert.
    assert max(share) <= sum(share) / num_nodes + max(heat.values()) + 1e-9


def test_a_layers_reads_go_to_single_copies_first_and_replicas_balance_around_them() -> None:
    """Expert 0 has copies on nodes 1 and 2, experts 1 and 2 live only on node 1, expert 3 only on node 2.
    Taken in expert order, 0 went to node 1 (a tie, its preferred copy) and then 1 and 2 piled on: 3 reads
    against 1. Single copies first, the replica fills the lighter node: 2 and 2."""
    p = Placement(2, {(5, 0): (1, 2), (5, 1): (1,), (5, 2): (1,), (5, 3): (2,), (5, 4): (2,)})
    assert p.assign(5, [0, 1, 2, 3], {1: 1.0, 2: 1.0}) == ({1: [1, 2], 2: [3, 0]}, [])
    assert p.assign(5, [0, 1, 2, 3], {1: 1.0, 2: 1.0}, fixed={0: 1}) == (
        {1: [0, 1, 2], 2: [3]},
        [],
    )  # its read started on 1
    assert p.assign(5, [0, 3, 4], {1: 1.0}) == (
        {1: [0]},
        [3, 4],
    )  # node 2 is down: its single copies have nowhere to go
    assert p.assign(5, [0, 1, 3], {1: 1.0, 2: 4.0})[0] == {
        1: [1],
        2: [3, 0],
    }  # a 4x faster node takes more per layer
    # A tie within the layer goes to the copy that has run fewer experts so far, not always to the preferred one.
    assert p.assign(5, [0], {1: 1.0, 2: 1.0})[0] == {1: [0]}
    assert p.assign(5, [0], {1: 1.0, 2: 1.0}, served={1: 7, 2: 5})[0] == {2: [0]}


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(1, 30), st.floats(0, 1), st.integers(0, 2**16))
def test_every_routed_expert_goes_once_to_a_live_copy(
    num_nodes: int, experts: int, hot: float, seed: int
) -> None:
    rng = random.Random(seed)
    p = make_placement({0: experts}, num_nodes, None, None, hot)
    alive = {r: 1.0 for r in range(1, num_nodes + 1) if rng.random() < 0.8}
    routed = rng.sample(range(experts), rng.randint(0, experts))
    by_node, orphans = p.assign(0, routed, alive)
    placed = [e for es in by_node.values() for e in es]
    assert sorted(placed + orphans) == sorted(routed)
    assert all(r in alive and r in p.owners[(0, e)] for r, es in by_node.items() for e in es)
    assert all(not set(p.owners[(0, e)]) & set(alive) for e in orphans)


def test_read_rate_weighs_the_share() -> None:
    p = make_placement({0: 30}, 2, None, [3000.0, 1000.0])
    assert len(p.experts_of(1)) in (22, 23) and len(p.experts_of(2)) == 30 - len(
        p.experts_of(1)
    )  # 3:1, as the rates


def test_sidecar_round_trips_and_a_stale_one_names_the_fix(tmp_path: Path) -> None:
    p = make_placement({1: 8, 2: 8}, 3, {(1, 0): 5.0}, None, 0.5)
    write_placement(tmp_path, p)
    got = read_placement(tmp_path)
    assert got == p
    check_placement(got, {1: 8, 2: 8}, 3, tmp_path)
    with pytest.raises(StoreError, match=r"trace warm --rebalance --nodes 2"):
        check_placement(got, {1: 8, 2: 8}, 2, tmp_path)
    (tmp_path / SIDECAR).write_text("{")
    with pytest.raises(StoreError, match=SIDECAR):
        read_placement(tmp_path)


def test_trace_warm_rebalance_nodes_writes_the_sidecar(tmp_path: Path) -> None:
    store = make_store("qwen3_moe", tmp_path)
    trace = tmp_path / "t.jsonl"
    assert (
        deltafind_cmd(
            "run",
            "--store",
            str(store),
            "--prompt",
            "hi there",
            "--max-new",
            "8",
            "--draft",
            "off",
            "--trace",
            str(trace),
        ).returncode
        == 0
    )
    proc = deltafind_cmd(
        "trace",
        "warm",
        str(trace),
        "--store",
        str(store),
        "--rebalance",
        "--nodes",
        "2",
        "--node-read-mb-s",
        "2000,2000",
        env={"DELTAFIND_CLUSTER__HOT_REPLICAS": "0.25"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "8 routed experts on 2 nodes" in proc.stdout and "2 replicated" in proc.stdout, (
        proc.stdout
    )
    placement = read_placement(store)
    counts = routed_counts(Manifest.load(store))
    assert counts == {1: 8}  # layer 0 is dense (slices stay with the coordinator)
    check_placement(placement, counts, 2, store)
    assert json.loads((store / SIDECAR).read_text())["num_nodes"] == 2


def test_per_node_stores_hold_only_their_experts_and_serve_the_same_tokens(tmp_path: Path) -> None:
    from deltafind.api import Model
    from deltafind.config import load_settings
    from tests.cluster.harness import cluster_settings, free_port, reaped, start_node

    store = make_store("qwen3_moe", tmp_path)
    ref = Model.open(store)
    try:
        want = ref.generate([5, 9, 33, 70], max_new_tokens=8)
    finally:
        ref.close()
    node_stores = []
    for rank in (1, 2):
        into = tmp_path / f"node{rank}"
        proc = deltafind_cmd(
            "setup", "--store", str(store), "--node", str(rank), "--into", str(into), "--nodes", "2"
        )
        assert proc.returncode == 0, proc.stderr
        node_stores.append(into)
    placement = read_placement(
        store
    )  # written by the first call, read by the second and by the coordinator
    for rank, into in enumerate(node_stores, 1):
        assert sorted(r.key for r in Manifest.load(into).experts) == placement.experts_of(rank)
        m = Manifest.load(into)
        reader = PackReader(
            m, into, verify=True
        )  # every record intact: each read checks its checksum
        try:
            for r in m.experts:
                reader.release(reader.read(r))
        finally:
            reader.close()
    port = free_port()
    with reaped(
        [start_node(into, rank, 3, port) for rank, into in enumerate(node_stores, 1)]
    ) as procs:
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
            assert model.generate([5, 9, 33, 70], max_new_tokens=8) == want
        finally:
            model.close()
        assert [p.wait(timeout=60) for p in procs] == [0, 0]
