"""Per-node stores: a node's routed experts only (`deltafind setup --store S --node R --into DIR`).

The placement comes from S's sidecar (written first, from heat, when S has none), so the
coordinator, which reads the same sidecar, sends each node only what its store holds. Each
record is read through the store's verified reader and copied whole into one new pack;
the manifest (same store id, model and checksums; new offsets) is written last, atomically.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace
from pathlib import Path

from deltafind.cluster.placement import (
    Placement,
    check_placement,
    make_placement,
    read_placement,
    write_placement,
)
from deltafind.cluster.runs import routed_counts
from deltafind.errors import StoreError
from deltafind.store.heat import read_heat
from deltafind.store.manifest import (
    MANIFEST_NAME,
    PACK_HEADER_BYTES,
    PACK_MAGIC,
    Manifest,
    align_up,
    pack_name,
)
from deltafind.store.reader import PackReader


def node_placement(
    store: Path, manifest: Manifest, num_nodes: int | None, hot_replicas: float
) -> Placement:
    """S's sidecar (checked), or a new one for `num_nodes` written beside the manifest."""
    counts = routed_counts(manifest)
    placement = read_placement(store)
    if placement is None:
        if not num_nodes:
            raise StoreError(
                f"{store} has no cluster placement yet: pass --nodes N (expert nodes) to compute it"
            )
        placement = make_placement(counts, num_nodes, read_heat(store), None, hot_replicas)
        write_placement(store, placement)
    check_placement(placement, counts, num_nodes or placement.num_nodes, store)
    return placement


def write_node_store(
    store: Path, rank: int, into: Path, num_nodes: int | None = None, hot_replicas: float = 0.0
) -> tuple[int, int]:
    """Write node `rank`'s store into `into`; returns (experts, bytes)."""
    store, into = Path(store), Path(into)
    manifest = Manifest.load(store)
    placement = node_placement(store, manifest, num_nodes, hot_replicas)
    if not 1 <= rank <= placement.num_nodes:
        raise StoreError(f"--node {rank}: the placement has nodes 1..{placement.num_nodes}")
    mine = set(placement.experts_of(rank))
    records = [r for r in manifest.experts if r.key in mine]
    if (into / MANIFEST_NAME).exists() and Manifest.load(into).store_id != manifest.store_id:
        raise StoreError(f"{into} holds another store; give each node store its own folder")
    drive = into / "drive0"
    drive.mkdir(parents=True, exist_ok=True)
    need = sum(align_up(r.length) for r in records) + PACK_HEADER_BYTES
    if shutil.disk_usage(drive).free < need:
        raise StoreError(f"{drive}: needs {need} bytes free for node {rank}'s experts")
    placed, offset = [], PACK_HEADER_BYTES
    reader = PackReader(manifest, store, verify=True)
    try:
        with open(drive / pack_name(0), "wb") as f:
            f.write(
                json.dumps({"magic": PACK_MAGIC, "store_id": manifest.store_id, "drive": 0})
                .encode()
                .ljust(PACK_HEADER_BYTES, b"\0")
            )
            for r in records:
                buf = reader.read(r)  # verified on the way
                try:
                    f.write(memoryview(buf)[: r.length])
                finally:
                    reader.release(buf)
                f.write(b"\0" * (align_up(r.length) - r.length))
                placed.append(replace(r, drive=0, offset=offset))
                offset += align_up(r.length)
            f.flush()
            os.fsync(f.fileno())
    finally:
        reader.close()
    node = replace(
        manifest,
        drives=["drive0"],
        experts=placed,
        pack_generation=0,
        source={**manifest.source, "cluster_node": rank, "cluster_nodes": placement.num_nodes},
    )
    node.save(into)
    return len(placed), sum(r.length for r in placed)
