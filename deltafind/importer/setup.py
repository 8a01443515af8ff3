"""Import a checkpoint into a store: spine, striped expert packs, tokenizer, manifest.

Resumable: a journal records each expert record once its pack bytes are on
disk; a rerun truncates the packs to the last journaled record and goes on
(the lock, journal and packs: importer/store_files.py).
Records are loaded, laid out and hashed on a few threads (a source that allows it) at most
PREPARE_AHEAD records a thread ahead of the one writer, which writes and journals them in store
order: never more than those tensor groups (an expert, or a dense MLP slice) in memory.
Which tensors are experts is the family's `WeightNames` (deltafind/provider.py), sorted by
importer/plan.py; this module knows no model's names.
"""

from __future__ import annotations

import hashlib
import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from pathlib import Path

import torch
import xxhash
from tqdm import tqdm

from deltafind.errors import StoreError
from deltafind.importer.checkpoint import open_source
from deltafind.importer.placement import MIN_STRIPE_BYTES, place, stripe_extents, write_record
from deltafind.importer.plan import (
    Durable,
    Parts,
    dense_slices_for,
    iter_expert_groups,
    plan_tensors,
)
from deltafind.importer.sources import Source, TensorInfo
from deltafind.importer.spine_writer import write_safetensors
from deltafind.importer.store_files import (
    _disk_errors,
    _naming,
    _open_packs,
    _replace_older_format,
    _sync_packs,
    drive_folders,
    existing_store,
    finish_store,
    open_journal,
    store_lock,
)
from deltafind.provider import HF_WEIGHTS, WeightNames
from deltafind.store.manifest import (
    MANIFEST_NAME,
    SPINE_NAME,
    ExpertRecord,
    Manifest,
    TensorEntry,
    align_up,
)

TENSOR_ALIGN = 64
JOURNAL_SYNC_EVERY = 64
PREPARE_AHEAD = 2  # records each preparing thread may hold ready ahead of the writer
MAX_PREPARE_THREADS = 4  # loads, copies and hashes: past a few threads the drives bound an import
Prepared = tuple[bytes, list[TensorEntry], str, str]  # payload, entries, sha256, xxh3


def _check_scales(layer: int, expert: int, parts: dict[str, torch.Tensor]) -> None:
    # E8M0 bytes 0 and 255 mean 2^-127 and inf/NaN; K3's scales lie strictly between (docs/kimi-k3-format.md §5.2).
    for name, t in parts.items():
        if name.endswith("weight_scale") and t.numel() and bool(((t == 0) | (t == 255)).any()):
            raise StoreError(
                f"layer {layer} expert {expert} {name}: E8M0 scale byte 0 or 255, outside what the checkpoint uses; re-download it"
            )


def record_layout(
    infos: dict[str, TensorInfo], quants: dict[str, str] | None = None
) -> tuple[int, list[TensorEntry]]:
    """An expert record's length and where each tensor goes: back to back in `infos` order, TENSOR_ALIGN-aligned."""
    entries, offset = [], 0
    for name, info in infos.items():
        offset = align_up(offset, TENSOR_ALIGN)
        entries.append(
            TensorEntry(
                name,
                str(info.dtype).removeprefix("torch."),
                info.shape,
                offset,
                info.nbytes,
                (quants or {}).get(name, ""),
            )
        )
        offset += info.nbytes
    return offset, entries


def expert_record_bytes(
    parts: dict[str, torch.Tensor], quants: dict[str, str] | None = None
) -> tuple[bytes, list[TensorEntry]]:
    """One expert's tensors as one record payload, laid out by `record_layout` (zeros in the gaps).

    Any dtype goes in byte for byte; K3's six MXFP4 tensors (all multiples of 64
    bytes) come out as exactly the released 17,547,264-byte blob.
    """
    length, entries = record_layout(
        {n: TensorInfo(t.dtype, tuple(t.shape)) for n, t in parts.items()}, quants
    )
    payload = bytearray(length)
    for e, t in zip(entries, parts.values(), strict=True):
        payload[e.offset : e.offset + e.nbytes] = (
            t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        )
    return bytes(payload), entries


def _prepare(layer: int, expert: int, load: Callable[[], Parts]) -> Prepared:
    """One record made ready to write: its tensors loaded and checked, laid out, hashed."""
    parts, quants = load()
    _check_scales(layer, expert, parts)
    payload, entries = expert_record_bytes(parts, quants)
    return payload, entries, hashlib.sha256(payload).hexdigest(), xxhash.xxh3_64_hexdigest(payload)


def prepare_threads(source: Source) -> int:
    """Threads that prepare records for `source`: 0 (the writer loads inline) unless it may be read
    from threads (`Source.parallel_load`)."""
    return min(MAX_PREPARE_THREADS, os.cpu_count() or 1) if source.parallel_load else 0


def prepared_records(
    groups: list[tuple[int, int, Callable[[], Parts]]], skip: set[tuple[int, int]], threads: int
) -> Iterator[tuple[int, int, int, Prepared]]:
    """(index in `groups`, layer, expert, prepared record) for each group not in `skip`, in store
    order. With `threads`, up to PREPARE_AHEAD x threads records are prepared ahead of the caller
    (hashlib, numpy and torch copy without the GIL); a failure is raised at its own record, in order."""
    todo = [(i, g) for i, g in enumerate(groups) if (g[0], g[1]) not in skip]
    if threads <= 0:
        for i, (layer, expert, load) in todo:
            yield i, layer, expert, _prepare(layer, expert, load)
        return
    pool = ThreadPoolExecutor(threads, thread_name_prefix="setup-prepare")
    ahead: deque = deque()
    try:
        for i, group in todo:
            ahead.append((i, group, pool.submit(_prepare, *group)))
            if len(ahead) > PREPARE_AHEAD * threads:
                j, (layer, expert, _), done = ahead.popleft()
                yield j, layer, expert, done.result()
        while ahead:
            j, (layer, expert, _), done = ahead.popleft()
            yield j, layer, expert, done.result()
    finally:  # the writer stopped (done, failed or interrupted): no thread reads the source after
        pool.shutdown(wait=True, cancel_futures=True)


def setup_store(
    source_path: Path | Source,
    store_dir: Path,
    drives: list[Path] | None = None,
    dense_slices: int | None = None,
    progress: bool = True,
    fault_after: int | None = None,
    names: WeightNames = HF_WEIGHTS,
    placement: str = "stripe",
    min_stripe_bytes: int = MIN_STRIPE_BYTES,
    threads: int | None = None,
) -> Manifest:
    """Import `source_path` (a path, or an open `Source` such as a synthetic one) into
    `store_dir`, each expert record split over all `drives` (`placement="stripe"`, records
    of at least 2 x `min_stripe_bytes`; smaller ones whole, round-robin) or whole, round-robin
    (`"whole"`): importer/placement.py. `names` is the family's
    (`family.weight_names(args)`; `deltafind setup` passes it). Dense MLPs are cut into
    `dense_slices` records each, or (None) as many as `plan.dense_slices_for` chooses by size.

    `fault_after` is for tests: raise after that many expert records, as an
    interrupt would. `threads` prepare records ahead of the writer (None: `prepare_threads`; 0: none).
    """
    store_dir = Path(store_dir)
    with store_lock(store_dir), _disk_errors(store_dir):
        source = source_path if isinstance(source_path, Source) else open_source(Path(source_path))
        source_str = (
            str(source.path)
            if isinstance(source_path, Source)
            else str(Path(source_path).resolve())
        )
        plan = plan_tensors(source.tensors, names)
        asked, dense_slices = dense_slices, dense_slices_for(source.tensors, plan, dense_slices)
        drive_dirs, drive_strs = drive_folders(store_dir, drives)
        params = {
            "fingerprint": source.fingerprint(),
            "source": source_str,
            "drives": drive_strs,
            "dense_slices": dense_slices,
        }

        if (store_dir / MANIFEST_NAME).exists():
            _replace_older_format(store_dir, params, any_slices=asked is None)
        if (existing := existing_store(store_dir, params, any_slices=asked is None)) is not None:
            return existing
        journal, store_id, done = open_journal(store_dir, params)
        durable = Durable(plan, dense_slices)
        source.begin_import(plan.spine, durable.names())
        records = [ExpertRecord.from_json(d["record"]) for d in done if d.get("kind") == "expert"]
        done_keys = {r.key for r in records}
        source.durable(durable.add(sorted(done_keys)))
        packs = _open_packs(drive_dirs, store_id, records)
        fresh: list[tuple[int, int]] = []  # written since the last sync

        def sync() -> None:
            _sync_packs(packs)
            journal.sync()
            source.durable(durable.add(fresh))  # a --delete-source shard goes only after this
            fresh.clear()

        try:
            groups = list(iter_expert_groups(source, plan, dense_slices))
            written = 0
            threads = prepare_threads(source) if threads is None else threads
            with (
                tqdm(
                    total=len(groups),
                    initial=len(done_keys),
                    unit="expert",
                    desc="experts",
                    disable=not progress,
                ) as bar,
                closing(prepared_records(groups, done_keys, threads)) as ready,
            ):
                for i, layer, expert, (payload, entries, sha256, xxh3) in ready:
                    ends = [end for _, end in packs]
                    size = align_up(len(payload))
                    extents = stripe_extents(
                        size,
                        ends,
                        i % len(ends),
                        min_stripe_bytes if placement == "stripe" else size + 1,
                    )
                    rec = place(
                        ExpertRecord(
                            layer,
                            expert,
                            0,
                            0,
                            len(payload),
                            sha256,
                            tuple(entries),
                            xxh3,
                        ),
                        extents,
                    )
                    with _naming(*(f.name for f, _ in packs)):
                        write_record([f for f, _ in packs], rec, payload)
                    packs = [(f, end) for (f, _), end in zip(packs, ends, strict=True)]
                    records.append(rec)
                    journal.add({"kind": "expert", "record": rec.to_json()})
                    fresh.append(rec.key)
                    written += 1
                    bar.update(1)
                    if len(journal.pending) >= JOURNAL_SYNC_EVERY:
                        sync()
                    if fault_after is not None and written >= fault_after:
                        sync()
                        raise KeyboardInterrupt("setup interrupted (test fault)")
            sync()
        finally:
            for f, _ in packs:
                f.close()

        # The spine goes after the experts: a hub source frees each shard once its experts are in
        # (its spine tensors staged), so peak disk stays near the store's size (importer/hub.py).
        spine_entry = next((d for d in done if d.get("kind") == "spine"), None)
        if spine_entry is None:
            tmp = store_dir / (SPINE_NAME + ".tmp")
            with _naming(tmp):
                spine_sha = write_safetensors(
                    tmp, {n: source.tensors[n] for n in plan.spine}, source.load
                )
            os.replace(tmp, store_dir / SPINE_NAME)
            journal.add({"kind": "spine", "sha256": spine_sha})
            journal.sync()
        else:
            spine_sha = spine_entry["sha256"]

        with _naming(store_dir / MANIFEST_NAME):
            manifest = finish_store(
                store_dir,
                source,
                journal,
                records,
                store_id=store_id,
                drives=drive_strs,
                dense_slices=dense_slices,
                source=params,
                spine_sha256=spine_sha,
                placement="stripe" if any(r.stripes for r in records) else "whole",
            )
        source.end_import()
        return manifest
