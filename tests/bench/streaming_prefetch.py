"""Prefetch on vs off in every configuration: cold and warm cache, 1 and 4 drives, batch 1 and 8.

Each run is its own subprocess (a cold process, its own reads); on and off alternate inside
each configuration and the configurations alternate inside each round, so load on this
shared machine hits both alike. Drives are capped with `read_mb_s` (emulated drives of
equal rate). Warm: a 1 GiB expert cache first filled by other prompts. Reached through
`bench_streaming.py --prefetch-matrix`; prints one JSON line per configuration, with
`os.getloadavg()` beside it.

    python tests/bench/bench_streaming.py --prefetch-matrix --root /tmp/dfbench [--rounds 2] [--before DIR]
    python tests/bench/streaming_prefetch.py --root /tmp/dfbench [--rounds 2] [--tokens 4] [--before DIR]   # this bench alone
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

WARM_CACHE_BYTES = 1 << 30
CONFIGS = [
    (cache, drives, batch) for cache in ("cold", "warm") for drives in (1, 4) for batch in (1, 8)
]


def one(cfg: dict[str, Any]) -> dict[str, Any]:
    """Decode `tokens` per sequence for `batch` sequences through the engine core; decode tok/s after the prefill step."""
    __import__("deltafind")  # first: it sets the OpenMP defaults before torch loads
    import torch

    from deltafind import Model
    from deltafind.engine.core import EngineCore
    from deltafind.engine.sampler import SamplingParams
    from deltafind.engine.sequence import GenRequest
    from deltafind.engine.step import SchedulerLimits
    from deltafind.store.manifest import Manifest
    from deltafind.store.reader import DriveOptions

    torch.set_num_threads(cfg.get("threads", 2))
    store = Path(cfg["store"])
    drives = [DriveOptions(queue_depth=8, read_mb_s=cfg.get("read_mb_s"))] * len(
        Manifest.load(store).drives
    )
    model = Model.open(
        store,
        expert_bytes=cfg["cache"],
        drives=drives,
        heat_decay=1.0,
        prefetch=cfg["prefetch"],
        max_in_flight=32,
    )
    batch = cfg["batch"]

    e = model.experts.stats

    def counters() -> list[int]:
        return [e.bytes_read, e.prefetch_issued, e.prefetch_used, e.prefetch_wasted]

    def drive(offset: int, tokens: int) -> tuple[float, int, list[int]]:
        core = EngineCore(
            model.net,
            model.eos_token_ids,
            SchedulerLimits(
                max_running=batch, max_queue=batch, max_step_tokens=1 << 20, max_context=1 << 20
            ),
        )
        for i in range(batch):
            core.add(
                GenRequest(
                    (65 + offset + i, 66, 67, 68),
                    SamplingParams(max_new_tokens=tokens, ignore_eos=True),
                ),
                i,
            )
        core.step()  # the prefill step (every prompt at once): not counted
        t0, new, c0 = time.perf_counter(), 0, counters()
        while core.has_work:
            new += sum(1 for _, ev in core.step() if hasattr(ev, "token_id"))
        return time.perf_counter() - t0, new, [a - b for a, b in zip(counters(), c0, strict=True)]

    if cfg["warm"]:
        drive(100, cfg["tokens"])  # other prompts fill the cache first
    seconds, new, (nbytes, issued, used, wasted) = drive(0, cfg["tokens"])
    out = {
        "decode_tok_s": new / seconds,
        "decode_s": seconds,
        "tokens": new,
        "bytes_read": nbytes,
        "prefetch_issued": issued,
        "prefetch_used": used,
        "prefetch_wasted": wasted,
        "recall_by_layer": {
            layer: round(r.recall, 3) for layer, r in sorted(e.layers.items()) if r.needed
        },
        "precision_by_layer": {
            layer: round(r.precision, 3) for layer, r in sorted(e.layers.items()) if r.predicted
        },
    }
    model.experts.uses.clear()  # keep the bench store's heat file out of it
    model.close()
    return out


def run(cfg: dict[str, Any], tree: Path | None, env: dict[str, str]) -> dict[str, Any]:
    """One configuration in a fresh process; `env` as before deltafind was imported, for both trees alike."""
    env = dict(env)
    if tree is not None:
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


def matrix(
    stores: dict[int, Path],
    rounds: int,
    tokens: int,
    cap_mb_s: float,
    threads: int,
    trees: dict[str, Path | None],
    env: dict[str, str],
) -> list[dict[str, Any]]:
    """Every configuration, prefetch on and off (and each tree), `rounds` times; medians and on/off ratios."""
    res: dict[tuple, list[dict[str, Any]]] = {}
    for _ in range(rounds):
        for cache, n, batch in CONFIGS:
            for name, tree in trees.items():
                for prefetch in (True, False):
                    cfg = {
                        "store": str(stores[n]),
                        "read_mb_s": cap_mb_s,
                        "threads": threads,
                        "batch": batch,
                        "prefetch": prefetch,
                        "tokens": tokens if batch == 1 else tokens // 2 + 1,
                        "warm": cache == "warm",
                        "cache": WARM_CACHE_BYTES if cache == "warm" else 0,
                    }
                    res.setdefault((name, cache, n, batch, prefetch), []).append(
                        run(cfg, tree, env)
                    )
    lines = []
    for name in trees:
        for cache, n, batch in CONFIGS:
            on, off = res[(name, cache, n, batch, True)], res[(name, cache, n, batch, False)]
            tok_on, tok_off = (
                statistics.median(r["decode_tok_s"] for r in rows) for rows in (on, off)
            )
            lines.append(
                {
                    "bench": "prefetch_matrix",
                    "tree": name,
                    "cache": cache,
                    "drives": n,
                    "batch": batch,
                    "cap_mb_s_per_drive": cap_mb_s,
                    "ratio_on_off": round(tok_on / tok_off, 3),
                    "tok_s_on_off": [round(tok_on, 3), round(tok_off, 3)],
                    "mb_per_token_on_off": [
                        round(
                            statistics.median(r["bytes_read"] / r["tokens"] for r in rows) / 1e6, 1
                        )
                        for rows in (on, off)
                    ],
                    "prefetch_used_wasted": [on[-1]["prefetch_used"], on[-1]["prefetch_wasted"]],
                    "recall_by_layer": on[-1]["recall_by_layer"],
                    "precision_by_layer": on[-1]["precision_by_layer"],
                    "loadavg": [round(x, 2) for x in os.getloadavg()],
                }
            )
    if len(trees) > 1:
        for cache, n, batch in CONFIGS:
            b, a = (
                next(
                    x
                    for x in lines
                    if x["tree"] == t and (x["cache"], x["drives"], x["batch"]) == (cache, n, batch)
                )
                for t in ("before", "after")
            )
            lines.append(
                {
                    "bench": "prefetch_matrix",
                    "cache": cache,
                    "drives": n,
                    "batch": batch,
                    "ratio_on_off_before_after": [b["ratio_on_off"], a["ratio_on_off"]],
                }
            )
    worst = min(x["ratio_on_off"] for x in lines if x.get("tree") == "after")
    lines.append(
        {
            "bench": "prefetch_never_loses",
            "min_ratio_on_off": worst,
            "configurations": len(CONFIGS),
            "rounds": rounds,
            "loadavg": [round(x, 2) for x in os.getloadavg()],
        }
    )
    return lines


def main() -> None:
    import argparse

    from bench_streaming import ENV, make_store

    ap = argparse.ArgumentParser()
    ap.add_argument("--root", type=Path, default=Path("/tmp/dfbench"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--tokens",
        type=int,
        default=6,
        help="new tokens per sequence at batch 1 (half, plus one, at batch 8)",
    )
    ap.add_argument("--cap-mb-s", type=float, default=150.0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--before", type=Path)
    ap.add_argument("--one")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(json.loads(args.one))))
        return
    args.root.mkdir(parents=True, exist_ok=True)
    stores = {n: make_store(args.root, n) for n in (1, 4)}
    trees: dict[str, Path | None] = {
        "after": None,
        **({"before": args.before} if args.before else {}),
    }
    for line in matrix(stores, args.rounds, args.tokens, args.cap_mb_s, args.threads, trees, ENV):
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
