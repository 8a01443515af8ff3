"""Where expert records lie on the drives: striping at setup, rebalancing (`trace warm --rebalance`).

Placement "stripe" (setup's default over several drives): each record of at
least 2 x MIN_STRIPE_BYTES is split into one piece per drive, read in parallel,
so every drive carries an equal share of every layer's reads whatever the
router picks (the per-layer barrier no longer waits on the busiest drive:
measured in tests/bench/RESULTS.md). Placement "whole" (older stores, small
records): each record on one drive, round-robin at setup; a skewed router then
keeps one drive busy while the others idle, so `--rebalance` spreads each
layer's heat evenly over the drives (a step reads one layer's experts at a
time), then fills with cold experts to balance bytes; `--rebalance --stripe`
rewrites a whole store as a striped one (the upgrade path). Crash-safe: the new packs are written beside the old
ones under the next generation's names and synced, `manifest.json` is
replaced atomically (the one commit point), and only then are the old packs
removed. A rerun after a crash removes whatever the manifest does not name
and starts over, so an interrupted rebalance costs time, never the store.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from deltafind.errors import StoreError
from deltafind.importer.store_files import store_lock
from deltafind.log import get_logger
from deltafind.store.manifest import (
    ALIGN,
    PACK_HEADER_BYTES,
    PACK_MAGIC,
    ExpertRecord,
    Extent,
    Manifest,
    align_up,
    fsync_dir,
    pack_name,
)
from deltafind.store.reader import DriveOptions, PackReader

log = get_logger(__name__)
LOCK_NAME = ".placement.lock"
CROSS_LAYER = 0.1
PACK_FILE = re.compile(r"^experts-(\d+)(?:\.g(\d+))?\.pack$")
# A stripe below one read chunk (store/drive_queue.py) costs more in per-read overhead than the
# balance gains; records under 2 x this stay whole (a demo's dense slices, the tests' tiny experts).
MIN_STRIPE_BYTES = 1 << 20
MIN_GAIN = 0.02  # rebalance: a smaller gain in heat imbalance leaves the packs as they are


def stripe_extents(
    size: int, ends: list[int], first: int, min_stripe: int = MIN_STRIPE_BYTES
) -> tuple[Extent, ...]:
    """Pieces of a record of `size` aligned bytes over the drives, starting at drive `first`
    (rotated per record so the shorter last piece does not always land on one drive);
    appends at `ends` (each drive's pack end), which it advances."""
    n = len(ends)
    k = max(1, min(n, size // min_stripe))
    pages, extra = divmod(size // ALIGN, k)  # k pieces whose sizes differ by at most one page
    out = []
    for j in range(k):
        d, nbytes = (first + j) % n, (pages + (j < extra)) * ALIGN
        out.append(Extent(d, ends[d], nbytes))
        ends[d] += nbytes
    return tuple(out)


def place(rec: ExpertRecord, extents: tuple[Extent, ...]) -> ExpertRecord:
    """`rec` at `extents` (one extent: a whole record)."""
    return replace(
        rec,
        drive=extents[0].drive,
        offset=extents[0].offset,
        stripes=extents if len(extents) > 1 else (),
    )


def write_record(files: Sequence[Any], rec: ExpertRecord, payload: bytes | memoryview) -> None:
    """Write `payload` (the record's bytes) at its extents in `files` (one per drive), zero-padded to 4096."""
    data = memoryview(payload)[: rec.length]
    pos = 0
    for e in rec.extents():
        f = files[e.drive]
        f.seek(e.offset)
        piece = data[pos : pos + e.nbytes]
        f.write(piece)
        if len(piece) < e.nbytes:
            f.write(b"\0" * (e.nbytes - len(piece)))
        pos += e.nbytes


def plan_placement(
    records: Sequence[ExpertRecord], heat: Mapping[tuple[int, int], float], num_drives: int
) -> dict[tuple[int, int], int]:
    """Drive for each expert. Per layer, hottest first, onto the drive with the least heat of
    that layer so far (plus a little of its overall heat), among drives still under an even
    share of that layer's bytes — so capacity stays balanced and cold experts fill the rest."""
    layers = sorted({r.layer for r in records})
    drive_heat = [0.0] * num_drives
    out: dict[tuple[int, int], int] = {}
    for layer in layers:
        recs = sorted(
            (r for r in records if r.layer == layer),
            key=lambda r: (-heat.get(r.key, 0.0), r.expert),
        )
        cap = sum(align_up(r.length) for r in recs) / num_drives + max(
            align_up(r.length) for r in recs
        )
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


def balance(
    records: Sequence[ExpertRecord],
    heat: Mapping[tuple[int, int], float],
    num_drives: int,
    where: Mapping[tuple[int, int], int] | None = None,
) -> Balance:
    h, b = [0.0] * num_drives, [0] * num_drives
    for r in records:
        if where is not None:
            h[where[r.key]] += heat.get(r.key, 0.0)
            b[where[r.key]] += align_up(r.length)
            continue
        for (
            e
        ) in r.extents():  # a striped record's heat lands on each drive in proportion to its piece
            h[e.drive] += heat.get(r.key, 0.0) * e.nbytes / align_up(r.length)
            b[e.drive] += e.nbytes
    return Balance(h, b)


def _drive_dirs(
    manifest: Manifest, store_dir: Path, drives: Sequence[DriveOptions] | None
) -> list[Path]:
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
    fault: Callable[[str], None] | None = None,
    stripe: bool = False,
    min_stripe_bytes: int = MIN_STRIPE_BYTES,
) -> tuple[Balance, Balance, bool]:
    """Rewrite the store's packs so each drive carries an even share of the heat (`stripe`: of every record).

    Returns (before, after, moved). A striped store keeps its placement (every
    drive already holds a share of every large record). Refuses (StoreError) when
    another rebalance holds the lock, when there is no heat (not needed with
    `stripe`), or when a drive lacks room for its new pack next to the old.
    `fault` is for tests: called at each stage name.
    """
    busy = "another `trace warm --rebalance` is running on this store; wait for it to finish"
    with store_lock(Path(store_dir), LOCK_NAME, busy):
        return _rebalance_locked(
            Path(store_dir),
            heat,
            drives,
            fault or (lambda _stage: None),
            stripe,
            min_stripe_bytes,
        )


def _rebalance_locked(
    store_dir: Path,
    heat: Mapping[tuple[int, int], float],
    drives: Sequence[DriveOptions] | None,
    fault: Callable[[str], None],
    stripe: bool,
    min_stripe: int,
) -> tuple[Balance, Balance, bool]:
    manifest = Manifest.load(store_dir)
    dirs = _drive_dirs(manifest, store_dir, drives)
    n = len(dirs)
    stale = _remove_stale(dirs, manifest.store_id, manifest.pack_generation)
    if stale:
        log.info("placement_stale_packs_removed", files=[str(f) for f in stale])
    before = balance(manifest.experts, heat, n)
    if stripe or manifest.placement == "stripe":
        new_records = striped_layout(manifest.experts, n, min_stripe)
        after = balance(new_records, heat, n)
        if n == 1 or manifest.placement == "stripe" or not any(r.stripes for r in new_records):
            return before, before, False
    else:
        if not any(heat.get(r.key, 0.0) > 0 for r in manifest.experts):
            raise StoreError(
                f"{store_dir}: no expert heat to balance by; record a trace (`deltafind run --trace FILE`) and pass it to `trace warm`"
            )
        where = plan_placement(manifest.experts, heat, n)
        after = balance(manifest.experts, heat, n, where)
        if n == 1 or before.heat_imbalance - after.heat_imbalance < MIN_GAIN:
            return before, before, False
        new_records = _new_layout(manifest.experts, where, n)
    gen = manifest.pack_generation + 1
    need = [
        PACK_HEADER_BYTES + sum(e.nbytes for r in new_records for e in r.extents() if e.drive == d)
        for d in range(n)
    ]
    by_device: dict[int, tuple[Path, int]] = {}
    for d, path in enumerate(dirs):
        dev = os.stat(path).st_dev
        by_device[dev] = (path, by_device.get(dev, (path, 0))[1] + need[d])
    for path, nbytes in by_device.values():
        free = shutil.disk_usage(path).free
        if free < nbytes * 1.02:
            raise StoreError(
                f"{path}: needs {nbytes} bytes free for the rebalanced pack(s) beside the old ones, has {free}; free space or skip --rebalance"
            )
    reader = PackReader(manifest, store_dir, verify=True, drives=list(drives) if drives else None)
    files = []
    try:
        for d in range(n):
            f = open(dirs[d] / pack_name(d, gen), "wb")  # noqa: SIM115 - closed below
            header = json.dumps(
                {"magic": PACK_MAGIC, "store_id": manifest.store_id, "drive": d, "generation": gen}
            ).encode()
            f.write(header.ljust(PACK_HEADER_BYTES, b"\0"))
            files.append(f)
        old = {r.key: r for r in manifest.experts}
        for i, r in enumerate(new_records):
            buf = reader.read(old[r.key])  # verified against its sha256 on the way
            try:
                write_record(files, r, buf)
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
        fsync_dir(d)
    fault("written")
    placement = "stripe" if any(r.stripes for r in new_records) else "whole"
    replace(
        manifest,
        experts=sorted(new_records, key=lambda r: r.key),
        pack_generation=gen,
        placement=placement,
    ).save(store_dir)  # the commit point
    fault("committed")
    _remove_stale(dirs, manifest.store_id, gen)
    log.info(
        "placement_rebalanced",
        generation=gen,
        heat_before=before.heat_per_drive,
        heat_after=after.heat_per_drive,
    )
    return before, after, True


def _new_layout(
    records: Sequence[ExpertRecord], where: Mapping[tuple[int, int], int], n: int
) -> list[ExpertRecord]:
    ends = [PACK_HEADER_BYTES] * n
    out = []
    for r in sorted(records, key=lambda r: r.key):
        d = where[r.key]
        out.append(replace(r, drive=d, offset=ends[d], stripes=()))
        ends[d] += align_up(r.length)
    return out


def striped_layout(
    records: Sequence[ExpertRecord], n: int, min_stripe: int = MIN_STRIPE_BYTES
) -> list[ExpertRecord]:
    """Every record split over the `n` drives (those under 2 x `min_stripe` whole, round-robin)."""
    ends = [PACK_HEADER_BYTES] * n
    return [
        place(r, stripe_extents(align_up(r.length), ends, i % n, min_stripe))
        for i, r in enumerate(sorted(records, key=lambda r: r.key))
    ]
