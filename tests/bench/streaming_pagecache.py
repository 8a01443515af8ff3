"""Page-cache policy: direct vs buffered reads on a store that fits in RAM, cold and warm.

Each run is a fresh process (bench_streaming.py `--one`): the store's packs are dropped from the
page cache, then the same prompt is decoded `passes` times with an expert cache of 0, so every
pass reads every expert it routes to again: pass 1 is cold for both modes, later passes find
the bytes in the page cache only when buffered. Modes alternate in every round. Per pass:
decode tok/s, CPU seconds per token (user + kernel, all threads: a warm buffered read is a
kernel memcpy, an O_DIRECT read a DMA), bytes the block layer read for the process
(/proc/self/io read_bytes: page-cache hits are not in it) and bytes the reader asked for.
Reached through `bench_streaming.py` (the `page_cache` lines).
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

MODES = ("direct", "buffered")


def _spread(xs: list[float], digits: int = 3) -> dict[str, float]:
    return {
        "median": round(statistics.median(xs), digits),
        "min": round(min(xs), digits),
        "max": round(max(xs), digits),
    }


def page_cache(
    run: Callable[[dict[str, Any]], dict[str, Any]],
    store: Path,
    rounds: int,
    tokens: int,
    threads: int,
    passes: int = 4,
) -> list[dict[str, Any]]:
    rows: dict[str, list[dict[str, Any]]] = {m: [] for m in MODES}
    for i in range(rounds):
        for mode in MODES if i % 2 == 0 else MODES[::-1]:  # alternate which mode goes first, too
            rows[mode].append(
                run(
                    {
                        "store": str(store),
                        "tokens": tokens,
                        "prefetch": False,
                        "passes": passes,
                        "read_mode": mode,
                        "threads": threads,
                    }
                )
            )
    out: dict[str, Any] = {
        "bench": "page_cache",
        "rounds": rounds,
        "passes_per_run": passes,
        "tokens_per_pass": tokens,
        "store_expert_bytes_per_pass": int(
            statistics.median(r["passes"][0]["reader_bytes"] for r in rows["direct"])
        ),
    }
    for mode in MODES:
        cold = [r["passes"][0] for r in rows[mode]]
        warm = [p for r in rows[mode] for p in r["passes"][1:]]
        out[mode] = {
            phase: {
                "decode_tok_s": _spread([p["decode_tok_s"] for p in ps]),
                "cpu_ms_per_token": _spread([1e3 * p["cpu_s"] / p["tokens"] for p in ps], 1),
                "wall_ms_per_token": _spread([1e3 * p["wall_s"] / p["tokens"] for p in ps], 1),
                "device_mb_per_token": _spread(
                    [p["device_read_bytes"] / p["tokens"] / 1e6 for p in ps], 2
                ),
                "reader_mb_per_token": _spread(
                    [p["reader_bytes"] / p["tokens"] / 1e6 for p in ps], 2
                ),
            }
            for phase, ps in (("cold", cold), ("warm", warm))
        }
        out[mode]["page_cache_growth_bytes"] = int(
            statistics.median(r["page_cache_growth_bytes"] for r in rows[mode])
        )
    ratio = {
        phase: {
            k: round(
                out["buffered"][phase][k]["median"] / max(1e-9, out["direct"][phase][k]["median"]),
                3,
            )
            for k in ("decode_tok_s", "cpu_ms_per_token", "device_mb_per_token")
        }
        for phase in ("cold", "warm")
    }
    out["buffered_over_direct"] = ratio
    out["loadavg"] = [round(x, 2) for x in os.getloadavg()]
    return [out]
