"""The persistent expert-heat histogram: a small decayed count file in the store.

`heat.json` maps "layer:expert" to a decayed use count, merged across runs:
each update takes an exclusive lock, decays what is on disk, adds this run's
uses and replaces the file atomically, so concurrent writers lose nothing and
a crash mid-write leaves the previous file intact.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Mapping
from pathlib import Path

from deltafind.log import get_logger
from deltafind.store.manifest import write_json_atomic

HEAT_NAME = "heat.json"
LOCK_NAME = ".heat.lock"
log = get_logger(__name__)


def read_heat(store_dir: Path) -> dict[tuple[int, int], float]:
    """The store's heat, or {} when there is none (or it is unreadable, which is logged)."""
    path = Path(store_dir) / HEAT_NAME
    try:
        raw = json.loads(path.read_text())
        return {_key(k): float(v) for k, v in raw.get("heat", {}).items()}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, AttributeError) as e:
        log.warning(
            "heat_file_unreadable", path=str(path), error=str(e), action="starting from empty heat"
        )
        return {}


def update_heat(
    store_dir: Path, uses: Mapping[tuple[int, int], float], decay: float = 0.99
) -> dict[tuple[int, int], float]:
    """Merge `uses` into the store's heat file (old counts times `decay`); returns the new heat."""
    store_dir = Path(store_dir)
    lock_fd = os.open(store_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        heat = {k: v * decay for k, v in read_heat(store_dir).items()}
        for k, n in uses.items():
            heat[k] = heat.get(k, 0.0) + float(n)
        heat = {k: v for k, v in heat.items() if v >= 1e-3}  # bounded: forget what has cooled off
        write_json_atomic(
            store_dir / HEAT_NAME,
            {
                "version": 1,
                "decay": decay,
                "heat": {f"{layer}:{e}": round(v, 4) for (layer, e), v in sorted(heat.items())},
            },
        )
        return heat
    finally:
        fcntl.flock(lock_fd, fcntl.LOCK_UN)
        os.close(lock_fd)


def hottest(heat: Mapping[tuple[int, int], float]) -> list[tuple[int, int]]:
    return [k for k, _ in sorted(heat.items(), key=lambda kv: (-kv[1], kv[0]))]


def _key(text: str) -> tuple[int, int]:
    layer, expert = text.split(":")
    return int(layer), int(expert)
