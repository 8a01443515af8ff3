"""Expert records of a streaming install: fetched from the hub by range on first use, then local.

A streaming store's manifest names `remote.json`: for each routed expert, where
its tensors lie in the remote shards. `submit(keys)`'s futures give records whose
bytes are in their pack: a missing one is fetched (neighbours of the same shard
coalesced into one range, bounded parallel transfers, retries in RangeClient),
checked, written in place, fsynced, then marked present in `present.jsonl`
(append-only, shared with `setup --fill` in another process). Knows records and
ranges, never models; the reader calls it before it reads a record.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import xxhash

from deltafind.errors import CorruptExpertError, StoreError
from deltafind.log import get_logger
from deltafind.store.manifest import ExpertRecord, Manifest
from deltafind.store.remote import RangeClient, RemoteError

log = get_logger(__name__)
REMOTE_NAME = "remote.json"
PRESENT_NAME = "present.jsonl"
COALESCE = (
    8  # experts per range request (docs/kimi-k3-drafting-io.md §9.2: 8 by default, at most 32)
)
MAX_COALESCE = 32
PARALLEL = 8  # range transfers at once
MAX_GAP_BYTES = 1 << 20  # neighbours further apart than this are fetched separately

Key = tuple[int, int]


@dataclass(frozen=True)
class Part:
    file: str
    start: int
    end: int


Views = Callable[[ExpertRecord, Any], dict[str, torch.Tensor]]  # record_tensors (store/buffers.py)


def plan_ranges(parts: Iterable[Part]) -> list[list[Part]]:
    """`parts` in runs, each fetched as one range from its first start to its last end.

    A part joins the run before it when the gap between them is at most MAX_GAP_BYTES and at most the
    part's own size, so the bytes fetched never exceed twice the bytes wanted: a GGUF keeps a layer's
    experts side by side in each of `ffn_{gate,up,down}_exps`, and with small experts a fixed 1 MiB
    gap fetched every expert between one expert's three tensors.
    """
    runs: list[list[Part]] = []
    end = 0
    for p in sorted(parts, key=lambda p: (p.file, p.start)):
        gap = p.start - end
        if runs and runs[-1][0].file == p.file and gap <= min(MAX_GAP_BYTES, p.end - p.start):
            runs[-1].append(p)
            end = max(end, p.end)
        else:
            runs.append([p])
            end = p.end
    return runs


class RemoteExperts:
    """Fetches missing records into the packs; thread-safe (the drive threads call `ensure`)."""

    def __init__(
        self,
        store_dir: Path,
        manifest: Manifest,
        pack_paths: list[Path],
        views: Views,
        coalesce: int = COALESCE,
        parallel: int = PARALLEL,
        client: RangeClient | None = None,
    ) -> None:
        path = store_dir / REMOTE_NAME
        try:
            meta = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise StoreError(
                f"{path}: unreadable ({e}); this streaming store cannot fetch its missing experts — run `deltafind setup --streaming` into a fresh --store"
            ) from e
        self.client = client or RangeClient(meta["repo_id"], meta["commit"], meta["endpoint"])
        self.meta, self.views = meta, views
        self.coalesce = max(1, min(coalesce, MAX_COALESCE))
        self.records = {r.key: r for r in manifest.experts}
        self.parts: dict[Key, list[Part]] = {
            (layer, e): [Part(*p) for p in parts] for layer, e, parts in meta["experts"]
        }
        self.present: dict[Key, ExpertRecord] = {k: r for k, r in self.records.items() if r.xxh3}
        self._order: dict[str, list[Key]] = {}
        for key in sorted(
            self.parts, key=lambda k: (self.parts[k][0].file, min(p.start for p in self.parts[k]))
        ):
            self._order.setdefault(self.parts[key][0].file, []).append(key)
        self._pos = {k: i for keys in self._order.values() for i, k in enumerate(keys)}
        self._journal = store_dir / PRESENT_NAME
        self._journal_pos = 0
        self._lock = threading.Lock()
        self._inflight: dict[Key, Future[ExpertRecord]] = {}
        self._fds = [os.open(p, os.O_RDWR) for p in pack_paths]
        self._pool = ThreadPoolExecutor(max_workers=parallel, thread_name_prefix="fetch")
        self._refresh()

    def _refresh(self) -> None:
        """Take in records marked present since the last look (by us or by `setup --fill`)."""
        try:
            size = self._journal.stat().st_size
        except FileNotFoundError:
            return
        if size <= self._journal_pos:
            return
        with open(self._journal, "rb") as f:
            f.seek(self._journal_pos)
            data = f.read(size - self._journal_pos)
        end = data.rfind(b"\n") + 1  # a line being appended right now waits for the next look
        for line in data[:end].splitlines():
            d = json.loads(line)
            key = (d["layer"], d["expert"])
            if key in self.records:
                self.present[key] = replace(self.records[key], sha256=d["sha256"], xxh3=d["xxh3"])
        self._journal_pos += end

    def present_bytes(self) -> int:
        return sum(r.length for r in self.present.values())

    def total_bytes(self) -> int:
        return sum(r.length for r in self.records.values())

    def missing(self) -> list[Key]:
        with self._lock:
            self._refresh()
            return [k for keys in self._order.values() for k in keys if k not in self.present]

    def submit(self, keys: Iterable[Key], force: bool = False) -> dict[Key, Future[ExpertRecord]]:
        """Start fetches for the missing `keys` (`force`: all of them), neighbours in a shard
        coalesced into one range, up to `coalesce` experts each."""
        out: dict[Key, Future[ExpertRecord]] = {}
        todo: list[Key] = []
        with self._lock:
            self._refresh()
            for key in dict.fromkeys(keys):
                if key not in self.parts:
                    raise CorruptExpertError(
                        f"expert {key[1]} of layer {key[0]}: neither on disk nor in {REMOTE_NAME}; re-run `deltafind setup`"
                    )
                if key in self._inflight:
                    out[key] = self._inflight[key]
                elif not force and key in self.present:
                    out[key] = done = Future()
                    done.set_result(self.present[key])
                else:
                    todo.append(key)
            for group in self._groups(todo):
                futs = {k: Future() for k in group}
                self._inflight.update(futs)
                out.update(futs)
                self._pool.submit(self._fetch, group, futs)
        return out

    def _groups(self, keys: list[Key]) -> list[list[Key]]:
        """Runs of keys that sit next to each other in their shard, up to `coalesce` long."""
        groups: list[list[Key]] = []
        for key in sorted(keys, key=lambda k: (self.parts[k][0].file, self._pos[k])):
            last = groups[-1][-1] if groups else None
            if (
                last is not None
                and len(groups[-1]) < self.coalesce
                and self.parts[last][0].file == self.parts[key][0].file
                and self._pos[key] == self._pos[last] + 1
                and min(p.start for p in self.parts[key]) - max(p.end for p in self.parts[last])
                <= MAX_GAP_BYTES
            ):
                groups[-1].append(key)
            else:
                groups.append([key])
        return groups

    def _fetch(self, group: list[Key], futs: dict[Key, Future[ExpertRecord]]) -> None:
        url = self.client.url(self.parts[group[0]][0].file)
        try:
            pieces = self._get_parts([p for k in group for p in self.parts[k]])
            for key in group:
                payload = self._assemble(key, pieces.__getitem__)
                problem = self._check(key, payload)
                if problem:  # a corrupt transfer: fetch this one alone, once more
                    log.warning(
                        "expert_fetch_corrupt",
                        layer=key[0],
                        expert=key[1],
                        problem=problem,
                        url=url,
                    )
                    payload = self._assemble(key, self._get_parts(self.parts[key]).__getitem__)
                    problem = self._check(key, payload)
                    if problem:
                        raise RemoteError(
                            f"{url}: the bytes of expert {key[1]} of layer {key[0]} fail their check twice ({problem})"
                        )
                self._finish(key, futs[key], self._publish(key, payload))
        except Exception as e:
            for key in group:
                if not futs[key].done():
                    err = CorruptExpertError(
                        f"expert {key[1]} of layer {key[0]} is not on disk yet and fetching it from {url} failed: {e}; "
                        "check the network and HF_TOKEN, or complete the store with `deltafind setup --fill`"
                    )
                    self._finish(key, futs[key], err)

    def _get_parts(self, parts: list[Part]) -> dict[Part, bytes]:
        """The bytes of `parts`: one range request per run of nearby parts of the same file."""
        out: dict[Part, bytes] = {}
        for run in plan_ranges(parts):
            start = run[0].start
            blob = self.client.get(run[0].file, start, max(p.end for p in run))
            for p in run:
                out[p] = blob[p.start - start : p.end - start]
        return out

    def _finish(
        self, key: Key, fut: Future[ExpertRecord], result: ExpertRecord | BaseException
    ) -> None:
        with self._lock:
            if self._inflight.get(key) is fut:
                del self._inflight[key]
        if isinstance(result, BaseException):
            fut.set_exception(result)
        else:
            fut.set_result(result)

    def _assemble(self, key: Key, piece: Any) -> bytes:
        """The record's payload: each tensor's bytes at its offset in the record (zeros between)."""
        rec = self.records[key]
        out = bytearray(rec.length)
        for entry, part in zip(rec.tensors, self.parts[key], strict=True):
            data = piece(part)
            if len(data) != entry.nbytes:
                raise RemoteError(
                    f"{self.client.url(part.file)} bytes {part.start}-{part.end - 1}: {len(data)} bytes for {entry.name}, the record holds {entry.nbytes}"
                )
            out[entry.offset : entry.offset + entry.nbytes] = data
        return bytes(out)

    def _check(self, key: Key, payload: bytes) -> str | None:
        """What a transfer could have broken and the format forbids: non-finite floats, E8M0 bytes 0/255."""
        for name, t in self.views(self.records[key], bytearray(payload)).items():
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                return f"{name} holds NaN or inf"
            if name.endswith("weight_scale") and t.numel() and bool(((t == 0) | (t == 255)).any()):
                return f"{name} holds an E8M0 scale byte 0 or 255"
        return None

    def _publish(self, key: Key, payload: bytes) -> ExpertRecord:
        """Write the record in place, fsync, then mark it present: a crash before the mark refetches it."""
        rec = self.records[key]
        fd = self._fds[rec.drive]
        if os.pwrite(fd, payload, rec.offset) != len(payload):
            raise StoreError(
                f"expert {key[1]} of layer {key[0]}: short write into its pack (disk full?)"
            )
        os.fsync(fd)
        full = replace(
            rec, sha256=hashlib.sha256(payload).hexdigest(), xxh3=xxhash.xxh3_64_hexdigest(payload)
        )
        line = (
            json.dumps(
                {"layer": rec.layer, "expert": rec.expert, "sha256": full.sha256, "xxh3": full.xxh3}
            )
            + "\n"
        )
        with self._lock:
            with open(
                self._journal, "a"
            ) as f:  # one short O_APPEND write: whole lines even with two writers
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
            self.present[key] = full
        return full

    def fetch_all(self, keys: list[Key], force: bool = False, progress: Any = None) -> list[str]:
        """Fetch `keys` (all at once, coalesced and bounded); returns the errors, one per failed expert."""
        futs = self.submit(keys, force=force)
        errors = []
        pending = set(futs.values())
        while pending:
            done, pending = wait(pending, return_when="FIRST_COMPLETED")
            for fut in done:
                if fut.exception() is not None:
                    errors.append(str(fut.exception()))
                elif progress is not None:
                    progress.update(fut.result().length)
        return errors

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        for fd in self._fds:
            os.close(fd)
        self._fds = []
