"""Entry point `deltafind`: doctor and trace (setup: setup_cli; run/bench: run_cli; serve: daemon/cli).

`deltafinctl` is control/ctl.py's `main`. Parses flags, builds Settings once, wires the API objects and maps
DeltafindError to a one-line message and its exit code — never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from deltafind.errors import DeltafindError, StoreError
from deltafind.run_cli import add_common, cli_settings, store_arg
from deltafind.setup_cli import add_subcommand as add_setup  # setup


def cmd_doctor(args: argparse.Namespace) -> int:
    from deltafind.models.ops.cpu_kernels import missing_note
    from deltafind.store.doctor import check_store

    report = check_store(store_arg(args, cli_settings(args)), progress=not args.quiet)
    if note := missing_note():
        print(f"warning: {note}", file=sys.stderr)
    for problem in report.problems:
        print(f"problem: {problem}", file=sys.stderr)
    status = "ok" if report.ok else f"{len(report.problems)} problem(s)"
    reading = f"; runs {report.reading}" if report.reading else ""
    print(
        f"{report.store}: {status}; {report.experts_checked} expert records, {report.bytes_checked / 2**20:.1f} MiB verified{reading}"
    )
    return 0 if report.ok else 4


def cmd_trace(args: argparse.Namespace) -> int:
    from deltafind.store.trace import heat_from_trace, read_trace, summarize

    records = read_trace(Path(args.file))
    if args.action == "summarize":
        summary = summarize(records, top=args.top)
        if args.json:
            print(json.dumps(summary))
        else:
            print(f"{summary['routes']} routes, {summary['distinct_experts']} distinct experts")
            for h in summary["hot_experts"]:
                print(f"  layer {h['layer']:3d} expert {h['expert']:4d}: {h['uses']} uses")
            for name in ("reuse_by_layer", "prediction_recall_by_layer"):
                if vals := summary[name]:
                    print(
                        f"{name.replace('_', ' ')}: "
                        + ", ".join(f"{k}: {v:.2f}" for k, v in vals.items())
                    )
        return 0
    from deltafind.store.heat import update_heat

    if not args.store:
        raise StoreError("trace warm needs --store DIR (the store whose heat file to warm)")
    settings = cli_settings(args)
    heat = update_heat(Path(args.store), heat_from_trace(records), settings.cache.heat_decay)
    print(
        f"{args.store}: heat file now covers {len(heat)} experts; set [cache] pin_bytes to keep the hottest resident"
    )
    # the cluster's placement of experts on nodes (deltafind/cluster)
    if args.rebalance and args.nodes:
        from deltafind.cluster.cli import rebalance_nodes

        print(
            rebalance_nodes(
                Path(args.store),
                heat,
                args.nodes,
                args.node_read_mb_s,
                settings.cluster.hot_replicas,
            )
        )
    elif args.rebalance:
        from deltafind.importer.placement import rebalance
        from deltafind.store.experts import drive_options
        from deltafind.store.manifest import Manifest

        before, after, moved = rebalance(
            Path(args.store), heat, drive_options(settings), stripe=args.stripe
        )

        def share(b: Any) -> str:
            return " / ".join(
                f"{h / max(1e-9, sum(b.heat_per_drive)):.0%}" for h in b.heat_per_drive
            )

        if args.stripe or Manifest.load(Path(args.store)).placement == "stripe":
            print(
                f"{'striped' if moved else 'placement kept'}: every large record is split over all {len(before.heat_per_drive)} drive(s)"
                f"{'' if moved else ' already (or the store has one drive, or records too small to split)'}"
            )
        elif moved:
            print(
                f"rebalanced: heat per drive {share(before)} -> {share(after)} (busiest/mean {before.heat_imbalance:.2f} -> {after.heat_imbalance:.2f})"
            )
        else:
            print(
                f"placement kept: heat per drive {share(before)} (busiest/mean {before.heat_imbalance:.2f}) is as even as a rebalance would make it"
            )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deltafind",
        description="Run a Mixture-of-Experts model with experts streamed from drives.",
    )
    add_common(parser)
    sub = parser.add_subparsers(dest="command")

    add_setup(sub)

    p = sub.add_parser(
        "doctor", help="re-verify every checksum of a store without loading the model"
    )
    add_common(p)
    p.add_argument("--store", metavar="DIR")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser(
        "trace", help="read a router trace: summarize it, or warm a store's heat from it"
    )
    add_common(p)
    p.add_argument("action", choices=["summarize", "warm"])
    p.add_argument("file", help="trace file written by --trace")
    p.add_argument("--store", metavar="DIR", help="with warm: the store to warm")
    p.add_argument(
        "--rebalance",
        action="store_true",
        help="with warm: rewrite the packs so each drive carries an even share of the heat (needs room for a second copy; crash-safe)",
    )
    p.add_argument(
        "--stripe",
        action="store_true",
        help="with --rebalance: split every large record over all drives instead (the upgrade of a store set up before striping)",
    )
    p.add_argument(
        "--nodes",
        type=int,
        metavar="N",
        help="with warm --rebalance: place the routed experts on N expert nodes of a cluster (writes cluster-placement.json)",
    )
    p.add_argument(
        "--node-read-mb-s",
        metavar="R1,R2,..",
        help="with --nodes: each node's read rate, to weigh its share (default: equal)",
    )
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_trace)

    from deltafind.cluster.cli import add_subcommand as add_node  # node
    from deltafind.daemon.cli import add_subcommands  # serve, install-service
    from deltafind.run_cli import add_subcommands as add_run  # run, bench

    add_run(sub)
    add_subcommands(sub)
    add_node(sub)
    # `deltafind --config F serve`: a subcommand's own --config, when not given, must not reset the one
    # given before it to None (argparse writes every subparser default over the parent's value).
    for subparser in sub.choices.values():
        for action in subparser._actions:
            if action.dest == "config":
                action.default = argparse.SUPPRESS
    return parser


def _run(func: Any, args: Any) -> int:
    try:
        return int(func(args))
    except DeltafindError as e:
        print(f"deltafind: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("deltafind: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        # `deltafind` alone runs the daemon, as the service does
        from deltafind.daemon.cli import cmd_serve

        return _run(cmd_serve, args)
    if args.func.__name__ != "cmd_serve":
        _quiet_logging()
    return _run(args.func, args)


def _quiet_logging() -> None:
    """One-shot commands print their answer on stdout; log lines go to stderr, warnings and up
    unless DELTAFIND_LOGGING__LEVEL says otherwise (the daemon configures its own)."""
    from deltafind.log import configure_logging

    level = os.environ.get("DELTAFIND_LOGGING__LEVEL", "warning")
    try:
        configure_logging(level, os.environ.get("DELTAFIND_LOGGING__FORMAT", "console"), sys.stderr)
    except ValueError as e:
        print(
            f"deltafind: warning: DELTAFIND_LOGGING__LEVEL/FORMAT: {e}; using warning/console",
            file=sys.stderr,
        )
        configure_logging("warning", "console", sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
