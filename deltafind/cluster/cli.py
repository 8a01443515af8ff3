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
    p = sub.add_parser("node", help="run an expert node of a cluster: holds some routed experts, computes them for the coordinator")
    p.add_argument("--config", metavar="FILE", help="TOML config of this node ([cluster] role = \"expert\" is implied)")
    p.add_argument("--store", metavar="DIR", help="store holding this node's experts (overrides [model] store)")
    p.add_argument("--rank", type=int, help="this node's rank, 1..N (overrides [cluster] rank and $RANK)")
    p.add_argument("--world-size", type=int, help="1 + the number of expert nodes (overrides [cluster] world_size)")
    p.add_argument("--coordinator", metavar="HOST", help="the coordinator's address (overrides [cluster] coordinator)")
    p.add_argument("--port", type=int, help="the group's port on the coordinator (overrides [cluster] port)")
    p.set_defaults(func=cmd_node)


def cmd_node(args: argparse.Namespace) -> int:
    from deltafind.cluster.node import serve_node
    from deltafind.config import load_settings
    from deltafind.log import configure_logging

    overrides = {"model": {"store": args.store},
                 "cluster": {"role": "expert", "rank": args.rank, "world_size": args.world_size,
                             "coordinator": args.coordinator, "port": args.port}}
    settings = load_settings(Path(args.config) if args.config else None, overrides)
    configure_logging(settings.logging.level, settings.logging.format)
    return serve_node(settings)
