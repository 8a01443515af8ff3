"""Expert-streaming benchmarks (issues 3, 15): efficiency, drive scaling, prefetch value, page cache, memory.

Each configuration runs in a fresh subprocess (cold expert cache, its own peak
RSS); configurations alternate so machine noise hits all of them alike.
Stores are seeded synthetic qwen3_moe stores with bf16 experts (9 MiB each, 64 a layer, top-8),
made on first use under --root: `qN` with whole records round-robin over N drive
folders (the layout before striping), `qNs` with every record striped over the N; 2 layers
for the capped benches. Efficiency (uncapped) runs on 8-layer stores (`q2-8l`, `q2s-8l`: the
issue's own store shape), where most layers are predicted from the layer before as in a deep
model; on 2 layers every other layer boundary is a token boundary, which nothing predicts well.
Each decode run's read rate is divided by raw parallel O_DIRECT reads of the same packs made
just before and just after it (`paired_raw_gb_s`, their mean: this disk drifts within seconds),
and the ratio is the median over runs. The same store is also decoded with each drive capped at
EFF_CAP_MB_S, under the slowest this disk was seen to read: there the drive's rate is known and holds
still, and the ratio is decode's read rate over the caps (`stripe_cap`, `stream_cap`).
Prints one JSON line per bench and a summary, with the load average.
`--before DIR` (a checkout of an older deltafind, e.g. `git archive REV | tar -x -C DIR`)
runs every configuration under both trees in the same rounds, side by side (the
older tree on the whole-record stores, which it can read).

    python tests/bench/bench_streaming.py --root /tmp/dfbench [--rounds 2] [--tokens 6] [--before DIR] [--pc-rounds 6]
    python tests/bench/bench_streaming.py --all --before DIR          # every drive measurement in one run (adds the prefetch matrix and prefill)
    python tests/bench/bench_streaming.py --only stripe,stream --rounds 6 --pc-rounds 0 --before DIR   # a focused rerun
    python tests/bench/bench_streaming.py --profile /tmp/dfbench/q2 --tokens 8 --no-prefetch   # where a decode spends its time
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import streaming_pagecache
from streaming_drives import (
    barrier_bounds,
    between_reads,
    device_read_bytes,
    drop_store_from_page_cache,
    page_cache_bytes,
    raw_odirect,
    time_fetches,
)
from streaming_summary import before_after, summarize

ENV = dict(
    os.environ
)  # before deltafind is imported here (it sets OMP_WAIT_POLICY): what --before runs get
SHAPE = {"layers": 2}  # the qwen3_moe "bench" shape, 2 layers: 128 experts x 9 MiB
DEEP = 8  # layers of the efficiency stores: 512 experts x 9 MiB, 4.8 GB
EFF_CAP_MB_S = (
    500.0  # per drive: 2 x 500 MB/s, under the ~1.5 GB/s floor of this VM's disk (RESULTS.md)
)


def make_store(
    root: Path, drives: int, placement: str = "whole", layers: int = SHAPE["layers"]
) -> Path:
    import deltafind.importer.synthetic_families  # noqa: F401 - registers the families
    from deltafind.importer.setup import setup_store
    from deltafind.importer.synthetic import FAMILIES, open_synthetic

    name = (
        f"q{drives}"
        + ("s" if placement == "stripe" else "")
        + (f"-{layers}l" if layers != SHAPE["layers"] else "")
    )
    store = root / name
    if not (store / "manifest.json").exists():
        fam = FAMILIES["qwen3_moe"]
        fam.shapes["bench-stream"] = {**fam.shapes["bench"], **SHAPE, "layers": layers}
        setup_store(
            open_synthetic("qwen3_moe", "bench-stream", 0),
            store,
            [root / f"{name}-drive{i}" for i in range(drives)],
            progress=False,
            placement=placement,
        )
    return store


def _rss_now() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def one(cfg: dict) -> dict:
    """Decode `tokens` tokens on a cold cache; report rates (runs in its own process)."""
    __import__("deltafind")  # first: deltafind sets its OpenMP defaults before torch loads
    import torch

    from deltafind import Model
    from deltafind.engine.sampler import SamplingParams
    from deltafind.store.manifest import Manifest
    from deltafind.store.reader import DriveOptions

    torch.set_num_threads(cfg.get("threads", 2))
    store = Path(cfg["store"])
    n_drives = len(Manifest.load(store).drives)
    drives = [
        DriveOptions(queue_depth=cfg.get("queue_depth", 8), read_mb_s=cfg.get("read_mb_s"))
    ] * n_drives
    if cfg.get("raw"):  # plain threads and O_DIRECT, not deltafind's reader (streaming_drives.py)
        return raw_odirect(store, cfg.get("queue_depth", 8), cfg.get("read_bytes", 1 << 20))
    runtime_rss = _rss_now()  # torch and deltafind imported, nothing loaded
    read_mode = (
        {"read_mode": cfg["read_mode"]} if "read_mode" in cfg else {}
    )  # an older tree has no such key
    if cfg.get("read_mode") == "buffered":
        drop_store_from_page_cache(store)
    cached0 = page_cache_bytes()
    model = Model.open(
        store,
        expert_bytes=cfg.get("cache", 0),
        drives=drives,
        prefetch=cfg.get("prefetch", True),
        max_in_flight=16,
        heat_decay=1.0,
        **read_mode,
    )
    spine_resident = sum(p.numel() * p.element_size() for p in model.net.parameters()) + sum(
        b.numel() * b.element_size() for b in model.net.buffers()
    )
    ids = [65, 66, 67, 68]
    params = SamplingParams(max_new_tokens=cfg["tokens"], ignore_eos=True)
    fetches = time_fetches(model.experts)
    passes = []
    # later passes: what a warm page cache gives a buffered reader
    for _ in range(cfg.get("passes", 1)):
        t0, r0, io0, d0 = (
            time.perf_counter(),
            resource.getrusage(resource.RUSAGE_SELF),
            device_read_bytes(),
            getattr(model.experts.reader, "bytes_read", 0),
        )
        list(model.stream(ids, params))
        wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
        passes.append(
            {
                "decode_tok_s": model.last_stats.decode_tok_s,
                "wall_s": wall,
                "tokens": cfg["tokens"],
                "cpu_s": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime),
                "device_read_bytes": device_read_bytes() - io0,
                "reader_bytes": getattr(model.experts.reader, "bytes_read", 0) - d0,
            }
        )
    s, e = model.last_stats, model.experts.stats
    reader = model.experts.reader
    out = {
        "decode_tok_s": s.decode_tok_s,
        "wall_s": wall,
        "cpu_s": (r1.ru_utime - r0.ru_utime)
        + (r1.ru_stime - r0.ru_stime),  # all threads, user + kernel
        "bytes_read": e.bytes_read,
        "read_gb_s": e.bytes_read / wall / 1e9,
        "io_wait_s": e.wait_s,
        "experts_per_token": e.requested / (s.new_tokens + len(ids) - 1),
        "prefetch_issued": e.prefetch_issued,
        "prefetch_used": e.prefetch_used,
        "prefetch_wasted": e.prefetch_wasted,
        "recall_by_layer": {
            layer: round(r.recall, 3) for layer, r in sorted(e.layers.items()) if r.needed
        },
        "precision_by_layer": {
            layer: round(r.precision, 3) for layer, r in sorted(e.layers.items()) if r.predicted
        },
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "spine_bytes": (store / "spine.safetensors").stat().st_size,
        "spine_resident_bytes": spine_resident,
        "runtime_rss_bytes": runtime_rss,
        "cache_used_bytes": model.experts.cache.used_bytes,
        "free_read_buffers_bytes": reader.buffers._free_bytes,
        "passes": passes,
        "page_cache_growth_bytes": page_cache_bytes() - cached0,
        "drive_bytes": getattr(reader, "bytes_read", e.bytes_read),  # wasted prefetches included
        "io": reader.io_stats() if hasattr(reader, "io_stats") else None,
        "between_reads": between_reads(fetches),
        "cap_gb_s": cfg["read_mb_s"] * n_drives / 1e3
        if cfg.get("read_mb_s")
        else None,  # the emulated drives' rate
    }
    model.experts.uses.clear()  # keep the bench store's heat file out of it
    model.close()
    return out


def profile(store: Path, tokens: int, threads: int, prefetch: bool) -> None:
    """cProfile the main thread over one cold decode (cache 0) and print where it spent its time."""
    import cProfile
    import pstats

    __import__("deltafind")
    import torch

    from deltafind import Model
    from deltafind.engine.sampler import SamplingParams

    torch.set_num_threads(threads)
    model = Model.open(store, expert_bytes=0, prefetch=prefetch, heat_decay=1.0)
    ids = [65, 66, 67, 68]
    list(model.stream(ids, SamplingParams(max_new_tokens=2, ignore_eos=True)))  # warm-up
    wait0, r0 = model.experts.stats.wait_s, resource.getrusage(resource.RUSAGE_SELF)
    prof = cProfile.Profile()
    prof.enable()
    list(model.stream(ids, SamplingParams(max_new_tokens=tokens, ignore_eos=True)))
    prof.disable()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    print(
        json.dumps(
            {
                "decode_tok_s": round(model.last_stats.decode_tok_s, 3),
                "io_wait_s": round(model.experts.stats.wait_s - wait0, 3),
                "cpu_user_s": round(r1.ru_utime - r0.ru_utime, 3),
                "cpu_kernel_s": round(r1.ru_stime - r0.ru_stime, 3),
            }
        )
    )
    pstats.Stats(prof).sort_stats("tottime").print_stats(10)
    model.experts.uses.clear()
    model.close()


def run(cfg: dict, tree: Path | None = None) -> dict:
    env = dict(os.environ) if tree is None else dict(ENV)
    if tree is not None:  # the older checkout's deltafind package wins over the installed one
        env["PYTHONPATH"] = str(tree)
    proc = subprocess.run(
        [sys.executable, __file__, "--one", json.dumps(cfg)],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    if proc.returncode:
        raise SystemExit(proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


# Uncapped, the disk's own rate is the reference, and on a shared virtual disk it moves 0.85-1.6 GB/s
# from minute to minute (RESULTS.md): each of these runs is divided by raw reads of its own packs
# made just before and just after it, not by a raw rate measured minutes away.
PAIRED = ("whole", "stripe", "stream")


def reads_stripes(tree: Path) -> bool:
    """Whether an older checkout's store code knows striped records (manifest `stripes`)."""
    manifest = tree / "deltafind" / "store" / "manifest.py"
    return manifest.exists() and "stripes" in manifest.read_text()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", type=Path, default=Path("/tmp/dfbench"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=6)
    ap.add_argument(
        "--cap-mb-s", type=float, default=150.0, help="per-drive read cap for the scaling bench"
    )
    ap.add_argument(
        "--before", type=Path, help="an older checkout to run side by side (its deltafind/ package)"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--profile", type=Path, metavar="STORE", help="instead: cProfile one cold decode on STORE"
    )
    ap.add_argument("--no-prefetch", action="store_true", help="with --profile")
    ap.add_argument(
        "--prefetch-matrix",
        action="store_true",
        help="also: prefetch on/off, cold/warm x 1/4 drives x batch 1/8 (streaming_prefetch.py)",
    )
    ap.add_argument(
        "--prefill",
        action="store_true",
        help="also: prefill bytes per prompt token and a 512-token K3 prompt projected (streaming_prefill.py)",
    )
    ap.add_argument(
        "--all",
        action="store_true",
        help="every drive measurement in one run: --prefetch-matrix and --prefill too",
    )
    ap.add_argument(
        "--pc-rounds",
        type=int,
        default=6,
        help="direct/buffered rounds of the page-cache bench (0: none)",
    )
    ap.add_argument(
        "--only",
        help="comma-separated configuration keys (raw,whole,stripe,stream,cap1,...): a focused rerun",
    )
    ap.add_argument("--one")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(json.loads(args.one))))
        return
    if args.profile:
        profile(args.profile, max(2, args.tokens), args.threads, not args.no_prefetch)
        return
    args.root.mkdir(parents=True, exist_ok=True)
    whole = {n: make_store(args.root, n) for n in (1, 2, 3, 4)}
    stripe = {n: make_store(args.root, n, "stripe") for n in (2, 3, 4)}
    deep, deep_stripe = (
        make_store(args.root, 2, layers=DEEP),
        make_store(args.root, 2, "stripe", DEEP),
    )
    t, th, cap = args.tokens, args.threads, args.cap_mb_s
    trees: dict[str, Path | None] = {
        "after": None,
        **({"before": args.before} if args.before else {}),
    }
    # (key, config, runs under an older tree too: any older tree, or one that reads striped stores)
    configs = [
        ("raw", {"store": str(deep_stripe), "raw": True}, False),
        ("raw_rec", {"store": str(deep_stripe), "raw": True, "read_bytes": 16 << 20}, False),
        ("whole", {"store": str(deep), "tokens": t, "prefetch": False}, True),
        ("stripe", {"store": str(deep_stripe), "tokens": t, "prefetch": False}, "stripes"),
        ("stream", {"store": str(deep_stripe), "tokens": t}, "stripes"),
        # the same drives capped under this disk's floor: their rate known, decode's share of it shows without the drift
        (
            "stripe_cap",
            {"store": str(deep_stripe), "tokens": t, "prefetch": False, "read_mb_s": EFF_CAP_MB_S},
            "stripes",
        ),
        (
            "stream_cap",
            {"store": str(deep_stripe), "tokens": t, "read_mb_s": EFF_CAP_MB_S},
            "stripes",
        ),
        *[
            (
                f"cap{n}",
                {
                    "store": str(whole[n]),
                    "tokens": max(2, t // 2),
                    "read_mb_s": cap,
                    "prefetch": False,
                },
                True,
            )
            for n in (1, 2, 3, 4)
        ],
        *[
            (
                f"caps{n}",
                {
                    "store": str(stripe[n]),
                    "tokens": max(2, t // 2),
                    "read_mb_s": cap,
                    "prefetch": False,
                },
                "stripes",
            )
            for n in (2, 3, 4)
        ],
        ("mem", {"store": str(whole[2]), "tokens": t, "cache": 1 << 30}, True),
    ]
    if args.only:
        configs = [c for c in configs if c[0] in args.only.split(",")]
    res: dict[str, dict[str, list[dict]]] = {name: {} for name in trees}
    for _ in range(args.rounds):
        for key, cfg, older_too in configs:
            for name, tree in trees.items():  # before and after back to back, so noise hits both
                if (
                    tree is None
                    or older_too is True
                    or (older_too == "stripes" and reads_stripes(tree))
                ):
                    raw_before = (
                        run({"store": cfg["store"], "raw": True})["raw_gb_s"]
                        if key in PAIRED
                        else None
                    )
                    row = run({**cfg, "threads": th}, tree)
                    # the disk's rate around the decode: read before and after it
                    if raw_before is not None:
                        raw_after = run({"store": cfg["store"], "raw": True})["raw_gb_s"]
                        row |= {
                            "paired_raw_gb_s": (raw_before + raw_after) / 2,
                            "paired_raw_before_after": [raw_before, raw_after],
                        }
                    res[name].setdefault(key, []).append(row)
    out = {name: summarize(r, t, cap) for name, r in res.items()}
    bounds = {"whole_4": barrier_bounds(whole[4]), "stripe_4": barrier_bounds(stripe[4])}
    for name, lines in out.items():
        for line in lines:
            if line["bench"] == "drive_scaling":
                line["per_layer_barrier_bound_4_drives"] = bounds
            print(json.dumps({"tree": name, **line, "loadavg": os.getloadavg()}), flush=True)
    if len(out) > 1:
        print(
            json.dumps(
                {
                    "bench": "before_after",
                    **before_after(out["before"], out["after"]),
                    "loadavg": os.getloadavg(),
                }
            ),
            flush=True,
        )
    for line in (
        streaming_pagecache.page_cache(lambda cfg: run(cfg), stripe[2], args.pc_rounds, t, th)
        if args.pc_rounds
        else []
    ):
        print(json.dumps(line), flush=True)
    if args.prefetch_matrix or args.all:
        import streaming_prefetch

        for line in streaming_prefetch.matrix(
            {n: whole[n] for n in (1, 4)}, args.rounds, args.tokens, args.cap_mb_s, th, trees, ENV
        ):
            print(json.dumps(line), flush=True)
    if args.prefill or args.all:
        import streaming_prefill

        for line in streaming_prefill.bench(args.root, ENV, th):
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
