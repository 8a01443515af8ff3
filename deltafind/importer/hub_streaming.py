"""`setup --streaming` and `setup --fill`: a store that serves before its experts are on disk.

A streaming install writes the spine, tokenizer, config and manifest, every
dense slice, and for every routed expert a record whose place in the packs is
reserved (sparse) and whose bytes stay in the hub's shards, mapped in
`remote.json`; store/remote_experts.py fetches them on first use. `fill_store`
fetches the rest, checks each shard against the sha256 the hub publishes
(rebuilt from the store's bytes, and the hub's for what the store changed, as
a GGUF's spine: a bad expert is found and refetched), and turns the store into
an ordinary one. The source is a `HubSource` or, from a GGUF repository, a
`GGUFHubSource` (importer/hub_gguf.py).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import xxhash
from tqdm import tqdm

from deltafind.errors import StoreError
from deltafind.importer.hub import HubSource, read_local_header
from deltafind.importer.hub_gguf import GGUFHubSource
from deltafind.importer.plan import dense_slices_for, iter_expert_groups, plan_tensors
from deltafind.importer.setup import expert_record_bytes, record_layout
from deltafind.importer.spine_writer import write_safetensors
from deltafind.importer.store_files import (
    _open_packs,
    _sync_packs,
    drive_folders,
    existing_store,
    finish_store,
    open_journal,
)
from deltafind.store.buffers import record_tensors
from deltafind.store.manifest import (
    SPINE_NAME,
    ExpertRecord,
    Manifest,
    align_up,
    pack_name,
    write_json_atomic,
)
from deltafind.store.remote_experts import PRESENT_NAME, REMOTE_NAME, RemoteExperts

READ_CHUNK = 16 << 20


def setup_streaming(
    source: HubSource | GGUFHubSource,
    store_dir: Path,
    drives: list[Path] | None = None,
    dense_slices: int | None = None,
    progress: bool = True,
    **plan_options: Any,
) -> Manifest:
    """Write a streaming store of `source` (a hub checkpoint) into `store_dir`; `plan_options` go to
    `plan_tensors` as setup_store passes them."""
    if not isinstance(source, HubSource | GGUFHubSource) or not source.streaming:
        raise StoreError(
            "--streaming installs from a hub: give --from ORG/NAME[@REVISION] (not --demo, --synthetic or a local path)"
        )
    store_dir = Path(store_dir)
    drive_dirs, drive_strs = drive_folders(store_dir, drives)
    plan = plan_tensors(source.tensors, **plan_options)
    asked, dense_slices = dense_slices, dense_slices_for(source.tensors, plan, dense_slices)
    params = {
        "fingerprint": source.fingerprint(),
        "source": str(source.path),
        "drives": drive_strs,
        "dense_slices": dense_slices,
        "streaming": True,
    }
    if (existing := existing_store(store_dir, params, any_slices=asked is None)) is not None:
        source.end_import()
        return existing
    journal, store_id, _ = open_journal(
        store_dir, params
    )  # a rerun after an interruption keeps the store id and the spine so far
    tmp = store_dir / (SPINE_NAME + ".tmp")
    spine = {n: source.tensors[n] for n in plan.spine}
    with tqdm(
        total=sum(i.nbytes for i in spine.values()),
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="spine",
        disable=not progress,
        mininterval=1.0,
    ) as bar:

        def load(name: str) -> Any:
            t = source.load(name)
            bar.update(spine[name].nbytes)
            return t

        spine_sha = write_safetensors(tmp, spine, load, resume=True)
    os.replace(tmp, store_dir / SPINE_NAME)

    records, remote = [], []
    packs = _open_packs(drive_dirs, store_id, [])
    try:
        groups = list(iter_expert_groups(source, plan, dense_slices))
        for i, (layer, expert, load) in enumerate(
            tqdm(groups, unit="expert", desc="records", disable=not progress)
        ):
            drive = i % len(drive_dirs)
            f, end = packs[drive]
            names = plan.routed.get((layer, expert))
            if names is not None:  # routed: its place is reserved, its bytes stay on the hub
                length, entries = record_layout(
                    {p: source.tensors[n] for p, n in names.items()},
                    {
                        p: source.tensors[n].quant
                        for p, n in names.items()
                        if source.tensors[n].quant
                    },
                )
                rec = ExpertRecord(layer, expert, drive, end, length, "", tuple(entries), None)
                spans = [source.remote[names[e.name]] for e in entries]
                remote.append([layer, expert, [[t.file, t.start, t.end] for t in spans]])
            else:  # a dense slice: every token reads it, so it is fetched now
                payload, entries = expert_record_bytes(*load())  # (tensors, quant tags)
                length = len(payload)
                f.seek(end)
                f.write(payload)
                rec = ExpertRecord(
                    layer,
                    expert,
                    drive,
                    end,
                    length,
                    hashlib.sha256(payload).hexdigest(),
                    tuple(entries),
                    xxhash.xxh3_64_hexdigest(payload),
                )
            records.append(rec)
            packs[drive] = (f, end + align_up(length))
        for f, end in packs:
            f.truncate(end)  # sparse: a record takes disk once its bytes arrive
        _sync_packs(packs)
    finally:
        for f, _ in packs:
            f.close()

    # only spine tensors stored as the hub holds them: `--fill` rebuilds a shard's sha256 from these (a GGUF's come from the hub)
    spine_remote = [
        [source.remote[n].file, source.remote[n].start, source.remote[n].end, n]
        for n in plan.spine
        if n in source.remote
    ]
    files = {
        f: {"size": source.repo.files[f].size, "sha256": source.repo.files[f].sha256}
        for f in source.shards
    }
    write_json_atomic(
        store_dir / REMOTE_NAME,
        {
            "repo_id": source.repo.repo_id,
            "commit": source.repo.commit,
            "endpoint": source.repo.endpoint,
            "files": files,
            "spine": spine_remote,
            "experts": remote,
        },
    )
    (store_dir / PRESENT_NAME).touch()
    manifest = finish_store(
        store_dir,
        source,
        journal,
        records,
        store_id=store_id,
        drives=drive_strs,
        dense_slices=dense_slices,
        source={**params, "remote": REMOTE_NAME},
        spine_sha256=spine_sha,
    )
    source.end_import()
    return manifest


def open_fetcher(store_dir: Path, manifest: Manifest) -> RemoteExperts:
    paths = [
        d / pack_name(i, manifest.pack_generation)
        for i, d in enumerate(manifest.drive_paths(store_dir))
    ]
    return RemoteExperts(store_dir, manifest, paths, record_tensors)


def fill_store(store_dir: Path, progress: bool = True) -> Manifest:
    """Fetch every missing expert, verify each shard against the hub's sha256, make the store ordinary."""
    store_dir = Path(store_dir)
    manifest = Manifest.load(store_dir)
    if not manifest.source.get("remote"):
        return manifest  # already complete
    fetcher = open_fetcher(store_dir, manifest)
    try:
        missing = fetcher.missing()
        total = sum(fetcher.records[k].length for k in missing)
        with tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc="fill",
            disable=not progress,
        ) as bar:
            errors = fetcher.fetch_all(missing, progress=bar)
        if errors:
            raise StoreError(
                f"{store_dir}: {len(errors)} expert(s) could not be fetched, first: {errors[0]}; run `deltafind setup --fill` again to retry"
            )
        for file, meta in fetcher.meta["files"].items():
            _verify_shard(store_dir, manifest, fetcher, file, meta)
        records = [fetcher.present[r.key] for r in manifest.experts]
    finally:
        fetcher.close()
    manifest.experts = records
    manifest.source = {k: v for k, v in manifest.source.items() if k != "remote"}
    manifest.save(store_dir)
    for name in (REMOTE_NAME, PRESENT_NAME):
        (store_dir / name).unlink(missing_ok=True)
    return manifest


def _verify_shard(
    store_dir: Path, manifest: Manifest, fetcher: RemoteExperts, file: str, meta: dict[str, Any]
) -> None:
    """Rebuild `file` from the store (the hub for what the store leaves out) and check its sha256;
    on a mismatch refetch the shard's experts once and check again."""
    if not meta.get("sha256"):
        return
    keys = [k for k, parts in fetcher.parts.items() if parts[0].file == file]
    if not keys:
        return
    for attempt in range(2):
        got = _shard_sha256(store_dir, manifest, fetcher, file, meta["size"])
        if got == meta["sha256"]:
            return
        if attempt == 0:
            fetcher.fetch_all(keys, force=True)
    raise StoreError(
        f"{fetcher.client.url(file)}: the store's bytes of this shard do not match the sha256 the hub publishes, even after refetching its experts; run `deltafind setup --fill` again, or re-install"
    )


def _shard_sha256(
    store_dir: Path, manifest: Manifest, fetcher: RemoteExperts, file: str, size: int
) -> str:
    """sha256 of `file` as the store holds it: experts from the packs, spine tensors from the spine,
    everything else (header, tensors the store leaves out) by range from the hub."""
    pieces: list[tuple[int, int, Any]] = []  # (start, end, read() -> bytes)
    packs = [
        d / pack_name(i, manifest.pack_generation)
        for i, d in enumerate(manifest.drive_paths(store_dir))
    ]
    for key, parts in fetcher.parts.items():
        rec = fetcher.present[key]
        for entry, p in zip(rec.tensors, parts, strict=True):
            if p.file == file:
                pieces.append(
                    (
                        p.start,
                        p.end,
                        lambda rec=rec, entry=entry: _pread(
                            packs[rec.drive], rec.offset + entry.offset, entry.nbytes
                        ),
                    )
                )
    spine = store_dir / SPINE_NAME
    _, local = read_local_header(spine, SPINE_NAME)
    for f, start, end, name in fetcher.meta["spine"]:
        if f == file and (t := local.get(name)) is not None and t.end - t.start == end - start:
            pieces.append((start, end, lambda t=t: _pread(spine, t.start, t.end - t.start)))
    pieces.sort(key=lambda x: x[0])
    h, pos = hashlib.sha256(), 0
    for start, end, read in [*pieces, (size, size, lambda: b"")]:
        while pos < start:  # bytes the store does not hold
            n = min(start - pos, READ_CHUNK)
            h.update(fetcher.client.get(file, pos, pos + n))
            pos += n
        h.update(read())
        pos = max(pos, end)
    return h.hexdigest()


def _pread(path: Path, offset: int, n: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(n)
