"""`deltafind node`: start an expert node of a cluster (systemd unit, torchrun, or by hand).

Settings come from the same TOML as the daemon's ([model] store and [[drives]] of this node,
[cache], [prefetch], [cluster]); flags override the file, $RANK/$WORLD_SIZE/$MASTER_* fill what
both leave unset.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_subcommand(sub: Any) -> None:
    p = sub.add_parser(
        "node",
        help="run an expert node of a cluster: holds some routed experts, computes them for the coordinator",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="TOML config of this node ([cluster] role = \"expert\" is implied)",
    )
    p.add_argument(
        "--store", metavar="DIR", help="store holding this node's experts (overrides [model] store)"
    )
    p.add_argument(
        "--rank", type=int, help="this node's rank, 1..N (overrides [cluster] rank and $RANK)"
    )
    p.add_argument(
        "--world-size",
        type=int,
        help="1 + the number of expert nodes (overrides [cluster] world_size)",
    )
    p.add_argument(
        "--coordinator",
        metavar="HOST",
        help="the coordinator's address (overrides [cluster] coordinator)",
    )
    p.add_argument(
        "--cluster-port",
        type=int,
        help="the group's port on the coordinator (overrides [cluster] port)",
    )
    p.set_defaults(func=cmd_node)


def cmd_node(args: argparse.Namespace) -> int:
    from deltafind.cluster.node import serve_node
    from deltafind.config import load_settings
    from deltafind.config.schema import by_section
    from deltafind.log import configure_logging

    flags = ("store", "rank", "world_size", "coordinator", "cluster_port")
    overrides = by_section({"role": "expert", **{k: getattr(args, k) for k in flags}})
    settings = load_settings(Path(args.config) if args.config else None, overrides)
    configure_logging(settings.logging.level, settings.logging.format)
    return serve_node(settings)


def rebalance_nodes(
    store: Path,
    heat: dict[tuple[int, int], float],
    num_nodes: int,
    rates: str | None,
    hot_replicas: float,
) -> str:
    """`trace warm --rebalance --nodes N`: recompute the store's cluster placement sidecar from its heat."""
    from deltafind.cluster.placement import make_placement, write_placement
    from deltafind.cluster.runs import routed_counts
    from deltafind.errors import ConfigError
    from deltafind.store.manifest import Manifest

    try:
        node_rates = [float(r) for r in rates.split(",")] if rates else None
    except ValueError:
        raise ConfigError(
            f"--node-read-mb-s {rates!r}: expected {num_nodes} numbers separated by commas, e.g. 2000,2000"
        ) from None
    counts = routed_counts(Manifest.load(store))
    placement = make_placement(counts, num_nodes, heat, node_rates, hot_replicas)
    path = write_placement(store, placement)
    share = [
        sum(heat.get(k, 1.0) / len(r) for k, r in placement.owners.items() if n in r)
        for n in range(1, num_nodes + 1)
    ]
    total = sum(share) or 1.0
    replicated = sum(1 for r in placement.owners.values() if len(r) > 1)
    return (
        f"{path}: {len(placement.owners)} routed experts on {num_nodes} nodes, heat per node "
        + " / ".join(f"{h / total:.0%}" for h in share)
        + f", {replicated} replicated on two nodes; "
        "restart the coordinator to use it"
    )
