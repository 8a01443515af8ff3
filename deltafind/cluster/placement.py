"""Which expert node holds which routed expert: computed from heat and node read rates, kept in a sidecar.

Each layer's experts go, hottest first, to the node whose share of that layer's heat per unit of
read rate is smallest, so every node's drives carry an even part of each layer's barrier; the
hottest `hot_replicas` fraction gets a second copy on another node. The coordinator decides and
sends the placement to the nodes when the group forms, so they can never disagree.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deltafind.errors import StoreError
from deltafind.store.manifest import write_json_atomic

SIDECAR = "cluster-placement.json"
VERSION = 1
Key = tuple[int, int]


@dataclass(frozen=True)
class Placement:
    """(layer, expert) -> the ranks (1..num_nodes) holding it, the preferred copy first."""

    num_nodes: int
    owners: Mapping[Key, tuple[int, ...]]

    def experts_of(self, rank: int) -> list[Key]:
        return sorted(k for k, ranks in self.owners.items() if rank in ranks)

    def layers(self) -> set[int]:
        return {layer for layer, _ in self.owners}

    def assign(
        self,
        layer: int,
        experts: Iterable[int],
        rates: Mapping[int, float],
        fixed: Mapping[int, int] | None = None,
        served: Mapping[int, int] | None = None,
    ) -> tuple[dict[int, list[int]], list[int]]:
        """Each of a layer's experts to the live copy (a node in `rates`, with its read rate) expected to
        finish first: the fewest of the layer's experts queued there per unit of rate, then the fewest
        experts `served` so far per unit of rate (ties to the preferred copy alone sent every tie of every
        layer to the same node: it read 4-8 % over the mean), then the preferred copy; `fixed` ones go
        where they are told (a prediction's read started there).
        Experts with one live copy are placed before the replicated ones, which then balance around
        them: in expert order, a replica placed early could take the node that the single-copy
        experts then piled onto. Returns (node -> its experts, the experts with no live copy)."""
        fixed, served = fixed or {}, served or {}
        live = {e: [r for r in self.owners.get((layer, e), ()) if r in rates] for e in experts}
        out: dict[int, list[int]] = {}
        orphans = []
        for e in sorted(live, key=lambda e: (0 if e in fixed else len(live[e]), e)):
            copies = live[e]
            if e in fixed:
                node = fixed[e]
            elif copies:
                node = min(
                    copies,
                    key=lambda r: (
                        (len(out.get(r, ())) + 1) / rates[r],
                        served.get(r, 0) / rates[r],
                        copies.index(r),
                    ),
                )
            else:
                orphans.append(e)
                continue
            out.setdefault(node, []).append(e)
        return out, orphans

    def to_json(self) -> dict[str, Any]:
        return {
            "version": VERSION,
            "num_nodes": self.num_nodes,
            "experts": [[layer, e, list(r)] for (layer, e), r in sorted(self.owners.items())],
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Placement:
        return cls(
            int(data["num_nodes"]),
            {
                (int(layer), int(e)): tuple(int(r) for r in ranks)
                for layer, e, ranks in data["experts"]
            },
        )


def make_placement(
    counts: Mapping[int, int],
    num_nodes: int,
    heat: Mapping[Key, float] | None = None,
    rates: Sequence[float] | None = None,
    hot_replicas: float = 0.0,
) -> Placement:
    """Place every expert of the routed layers `counts` (layer -> experts) on `num_nodes` nodes.

    `heat` (store/heat.py; missing experts count 1) and `rates` (each node's read rate, any unit;
    default equal) balance heat per rate within each layer; ties go to the lower rank.
    """
    if num_nodes < 1:
        raise StoreError("a cluster needs at least one expert node ([cluster] world_size >= 2)")
    rates = list(rates) if rates else [1.0] * num_nodes
    if len(rates) != num_nodes or min(rates) <= 0:
        raise StoreError(f"expected {num_nodes} positive node read rates, got {rates}")
    heat = heat or {}
    owners: dict[Key, tuple[int, ...]] = {}
    for layer, n in sorted(counts.items()):
        order = sorted(range(n), key=lambda e: (-heat.get((layer, e), 1.0), e))
        load = [0.0] * num_nodes
        hot = round(hot_replicas * n) if num_nodes > 1 else 0
        for i, e in enumerate(order):
            h = heat.get((layer, e), 1.0)
            copies = 2 if i < hot else 1
            chosen: list[int] = []
            for _ in range(copies):
                node = min(
                    (j for j in range(num_nodes) if j not in chosen),
                    key=lambda j: ((load[j] + h / copies) / rates[j], j),
                )
                load[node] += h / copies  # a replicated expert's reads split between its copies
                chosen.append(node)
            owners[(layer, e)] = tuple(j + 1 for j in chosen)
    return Placement(num_nodes, owners)


def read_placement(store_dir: Path) -> Placement | None:
    """The store's placement sidecar, or None without one."""
    path = Path(store_dir) / SIDECAR
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as e:
        raise StoreError(
            f"{path}: unreadable ({e}); delete it or recompute it with `deltafind trace warm --rebalance --nodes N`"
        ) from e
    if data.get("version") != VERSION:
        raise StoreError(
            f"{path}: placement version {data.get('version')!r}, this deltafind reads {VERSION}; "
            "recompute it with `deltafind trace warm --rebalance --nodes N`"
        )
    return Placement.from_json(data)


def write_placement(store_dir: Path, placement: Placement) -> Path:
    """Write the sidecar atomically (a reader sees the old file or the new one)."""
    path = Path(store_dir) / SIDECAR
    write_json_atomic(path, placement.to_json())
    return path


def check_placement(
    placement: Placement, counts: Mapping[int, int], num_nodes: int, where: Path
) -> None:
    """A sidecar must cover exactly these routed experts on exactly these nodes."""
    want = {(layer, e) for layer, n in counts.items() for e in range(n)}
    if (
        placement.num_nodes != num_nodes
        or set(placement.owners) != want
        or any(
            not ranks or any(not 1 <= r <= num_nodes for r in ranks)
            for ranks in placement.owners.values()
        )
    ):
        raise StoreError(
            f"{where / SIDECAR}: placed for {placement.num_nodes} nodes and {len(placement.owners)} experts, this "
            f"cluster has {num_nodes} nodes and {len(want)} routed experts; recompute it with "
            f"`deltafind trace warm --rebalance --nodes {num_nodes}` (or delete it)"
        )
