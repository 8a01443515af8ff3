"""Rebalance expert placement across drives by heat (`deltafind trace warm --rebalance`).

Setup stripes experts round-robin, blind to which are hot; a skewed router
then keeps one drive busy while the others idle. This spreads each layer's
heat evenly over the drives (a step reads one layer's experts at a time, so
per-layer balance is what keeps every drive busy), then fills with cold
experts to balance bytes. Crash-safe: the new packs are written beside the old
ones under the next generation's names and synced, `manifest.json` is
replaced atomically (the one commit point), and only then are the old packs
removed. A rerun after a crash removes whatever the manifest does not name
and starts over, so an interrupted rebalance costs time, never the store.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from deltafind.errors import StoreError
from deltafind.log import get_logger
from deltafind.store.manifest import (
    PACK_HEADER_BYTES,
    PACK_MAGIC,
    ExpertRecord,
    Manifest,
    align_up,
    pack_name,
)
from deltafind.store.reader import DriveOptions, PackReader

log = get_logger(__name__)
LOCK_NAME = ".placement.lock"
CROSS_LAYER = 0.1
PACK_FILE = re.compile(r"^experts-(\d+)(?:\.g(\d+))?\.pack$")


def plan_placement(records: Sequence[ExpertRecord], heat: Mapping[tuple[int, int], float], num_drives: int) -> dict[tuple[int, int], int]:
    """Drive for each expert. Per layer, hottest first, onto the drive with the least heat of
    that layer so far (plus a little of its overall heat), among drives still under an even
    share of that layer's bytes — so capacity stays balanced and cold experts fill the rest."""
    layers = sorted({r.layer for r in records})
    drive_heat = [0.0] * num_drives
    out: dict[tuple[int, int], int] = {}
    for layer in layers:
        recs = sorted((r for r in records if r.layer == layer), key=lambda r: (-heat.get(r.key, 0.0), r.expert))
        cap = sum(align_up(r.length) for r in recs) / num_drives + max(align_up(r.length) for r in recs)
        lh, lb = [0.0] * num_drives, [0] * num_drives
        for r in recs:
            h, size = max(heat.get(r.key, 0.0), 0.0), align_up(r.length)
            fits = [i for i in range(num_drives) if lb[i] + size <= cap] or list(range(num_drives))
            # A tenth of the drive's overall heat breaks near-ties, so the drive that got a layer's odd
            # hot expert does not also get the next layer's (measured: 1.22 -> 1.01 busiest/mean overall).
            d = min(fits, key=lambda i: (lh[i] + CROSS_LAYER * drive_heat[i], lb[i], i))
            out[r.key] = d
            lh[d] += h
            lb[d] += size
            drive_heat[d] += h
    return out


@dataclass(frozen=True)
class Balance:
    heat_per_drive: list[float]
    bytes_per_drive: list[int]

    @property
    def heat_imbalance(self) -> float:
        """Busiest drive's heat over the mean (1.0 = perfectly even)."""
        mean = sum(self.heat_per_drive) / len(self.heat_per_drive)
        return max(self.heat_per_drive) / mean if mean else 1.0


def balance(records: Sequence[ExpertRecord], heat: Mapping[tuple[int, int], float], num_drives: int, where: Mapping[tuple[int, int], int] | None = None) -> Balance:
    h, b = [0.0] * num_drives, [0] * num_drives
    for r in records:
        d = where[r.key] if where is not None else r.drive
        h[d] += heat.get(r.key, 0.0)
        b[d] += align_up(r.length)
    return Balance(h, b)


def _drive_dirs(manifest: Manifest, store_dir: Path, drives: Sequence[DriveOptions] | None) -> list[Path]:
    recorded = manifest.drive_paths(store_dir)
    opts = list(drives or [])
    return [(opts[i].path if i < len(opts) and opts[i].path else d) for i, d in enumerate(recorded)]


def _remove_stale(dirs: Sequence[Path], store_id: str, generation: int) -> list[Path]:
    """Delete this store's pack files of other generations (an interrupted run's output, or the old packs)."""
    removed = []
    for idx, d in enumerate(dirs):
        if not d.is_dir():
            continue
        for f in d.iterdir():
            m = PACK_FILE.match(f.name)
            if m and int(m[1]) == idx and int(m[2] or 0) != generation and _ours(f, store_id):
                f.unlink()
                removed.append(f)
    return removed


def _ours(path: Path, store_id: str) -> bool:
    """A pack whose header names this store, or one cut off before its header was written."""
    with open(path, "rb") as f:
        head = f.read(PACK_HEADER_BYTES)
    if len(head) < PACK_HEADER_BYTES and not head.strip(b"\0"):
        return True
    try:
        return json.loads(head.rstrip(b"\0")).get("store_id") == store_id
    except ValueError:
        return False


def rebalance(
    store_dir: Path,
    heat: Mapping[tuple[int, int], float],
    drives: Sequence[DriveOptions] | None = None,
    min_gain: float = 0.02,
    fault: Callable[[str], None] | None = None,
) -> tuple[Balance, Balance, bool]:
    """Rewrite the store's packs so each drive carries an even share of the heat.

    Returns (before, after, moved). Refuses (StoreError) when another rebalance
    holds the lock, when there is no heat, or when a drive lacks room for its
    new pack next to the old. `fault` is for tests: called at each stage name.
    """
    store_dir = Path(store_dir)
    lock_fd = os.open(store_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StoreError(f"{store_dir}: another `trace warm --rebalance` is running on this store; wait for it to finish") from None
        return _rebalance_locked(store_dir, heat, drives, min_gain, fault or (lambda _stage: None))
    finally:
        os.close(lock_fd)


def _rebalance_locked(store_dir: Path, heat: Mapping[tuple[int, int], float], drives: Sequence[DriveOptions] | None,
                      min_gain: float, fault: Callable[[str], None]) -> tuple[Balance, Balance, bool]:
    manifest = Manifest.load(store_dir)
    dirs = _drive_dirs(manifest, store_dir, drives)
    n = len(dirs)
    stale = _remove_stale(dirs, manifest.store_id, manifest.pack_generation)
    if stale:
        log.info("placement_stale_packs_removed", files=[str(f) for f in stale])
    if not any(heat.get(r.key, 0.0) > 0 for r in manifest.experts):
        raise StoreError(f"{store_dir}: no expert heat to balance by; record a trace (`deltafind run --trace FILE`) and pass it to `trace warm`")
    before = balance(manifest.experts, heat, n)
    where = plan_placement(manifest.experts, heat, n)
    after = balance(manifest.experts, heat, n, where)
    if n == 1 or before.heat_imbalance - after.heat_imbalance < min_gain:
        return before, before, False
    gen = manifest.pack_generation + 1
    new_records = _new_layout(manifest.experts, where, n)
    need = [PACK_HEADER_BYTES + sum(align_up(r.length) for r in new_records if r.drive == d) for d in range(n)]
    by_device: dict[int, tuple[Path, int]] = {}
    for d, path in enumerate(dirs):
        dev = os.stat(path).st_dev
        by_device[dev] = (path, by_device.get(dev, (path, 0))[1] + need[d])
    for path, nbytes in by_device.values():
        free = shutil.disk_usage(path).free
        if free < nbytes * 1.02:
            raise StoreError(f"{path}: needs {nbytes} bytes free for the rebalanced pack(s) beside the old ones, has {free}; free space or skip --rebalance")
    reader = PackReader(manifest, store_dir, verify=True, drives=list(drives) if drives else None)
    files = []
    try:
        for d in range(n):
            f = open(dirs[d] / pack_name(d, gen), "wb")  # noqa: SIM115 - closed below
            header = json.dumps({"magic": PACK_MAGIC, "store_id": manifest.store_id, "drive": d, "generation": gen}).encode()
            f.write(header.ljust(PACK_HEADER_BYTES, b"\0"))
            files.append(f)
        old = {r.key: r for r in manifest.experts}
        for i, r in enumerate(new_records):
            buf = reader.read(old[r.key])  # verified against its sha256 on the way
            try:
                f = files[r.drive]
                f.seek(r.offset)
                f.write(memoryview(buf)[: r.length])
                if align_up(r.length) > r.length:
                    f.write(b"\0" * (align_up(r.length) - r.length))
            finally:
                reader.release(buf)
            if i == len(new_records) // 2:
                fault("copying")
        for f in files:
            f.flush()
            os.fsync(f.fileno())
    finally:
        for f in files:
            f.close()
        reader.close()
    for d in dirs:
        _fsync_dir(d)
    fault("written")
    replace(manifest, experts=sorted(new_records, key=lambda r: r.key), pack_generation=gen).save(store_dir)  # the commit point
    fault("committed")
    _remove_stale(dirs, manifest.store_id, gen)
    log.info("placement_rebalanced", generation=gen, heat_before=before.heat_per_drive, heat_after=after.heat_per_drive)
    return before, after, True


def _new_layout(records: Sequence[ExpertRecord], where: Mapping[tuple[int, int], int], n: int) -> list[ExpertRecord]:
    ends = [PACK_HEADER_BYTES] * n
    out = []
    for r in sorted(records, key=lambda r: r.key):
        d = where[r.key]
        out.append(replace(r, drive=d, offset=ends[d]))
        ends[d] += align_up(r.length)
    return out


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
