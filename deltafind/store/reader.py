"""Read expert records from the drives' pack files and check them.

v1: positional reads (`os.preadv`) into fresh buffers, one open descriptor per
pack. The streaming work replaces the internals (per-drive pools, O_DIRECT),
not this face.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from pathlib import Path

import torch

from deltafind.errors import CorruptExpertError, StoreError
from deltafind.store.manifest import PACK_HEADER_BYTES, PACK_MAGIC, ExpertRecord, Manifest, pack_name


class PackReader:
    """Open packs of one store; `read(record)` returns the checked payload."""

    def __init__(self, manifest: Manifest, store_dir: Path, verify: bool = True) -> None:
        self.verify = verify
        self.paths = [d / pack_name(i) for i, d in enumerate(manifest.drive_paths(store_dir))]
        self._fds: list[int] = []
        self.bytes_read = 0
        self.read_s = 0.0
        self._lock = threading.Lock()
        for idx, path in enumerate(self.paths):
            if not path.parent.is_dir():
                self.close()
                raise StoreError(f"drive {idx} ({path.parent}) is missing: mount it, or fix the store's drive list in [[drives]]")
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as e:
                self.close()
                raise StoreError(f"drive {idx}: cannot open {path} ({e.strerror}); is the drive mounted and readable?") from e
            self._fds.append(fd)
            head = os.pread(fd, PACK_HEADER_BYTES, 0).rstrip(b"\0")
            try:
                meta = json.loads(head)
            except json.JSONDecodeError:
                meta = {}
            if meta.get("magic") != PACK_MAGIC or meta.get("store_id") != manifest.store_id or meta.get("drive") != idx:
                self.close()
                raise StoreError(f"drive {idx}: {path} is not this store's pack (drive order changed, or a different store's drive?)")

    def read(self, rec: ExpertRecord) -> bytearray:
        buf = bytearray(rec.length)
        t0 = time.perf_counter()
        try:
            n = os.preadv(self._fds[rec.drive], [buf], rec.offset)
        except OSError as e:
            raise CorruptExpertError(f"expert {rec.expert} of layer {rec.layer}: read failed on drive {rec.drive} ({self.paths[rec.drive]}: {e.strerror})") from e
        elapsed = time.perf_counter() - t0
        if n != rec.length:
            raise CorruptExpertError(f"expert {rec.expert} of layer {rec.layer}: short read on drive {rec.drive} ({n} of {rec.length} bytes); the pack {self.paths[rec.drive]} is truncated — re-run setup")
        if self.verify and hashlib.sha256(buf).hexdigest() != rec.sha256:
            raise CorruptExpertError(
                f"expert {rec.expert} of layer {rec.layer}: checksum mismatch in {self.paths[rec.drive]} at offset {rec.offset}; "
                "the drive returned corrupt data — run `deltafind doctor` and re-import the store"
            )
        with self._lock:
            self.bytes_read += n
            self.read_s += elapsed
        return buf

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []


def record_tensors(rec: ExpertRecord, buf: bytearray) -> dict[str, torch.Tensor]:
    """Views of the record's tensors over `buf` (no copy)."""
    out = {}
    for t in rec.tensors:
        dtype = getattr(torch, t.dtype)
        count = t.nbytes // torch.empty(0, dtype=dtype).element_size()
        out[t.name] = torch.frombuffer(buf, dtype=dtype, count=count, offset=t.offset).view(t.shape) if count else torch.empty(t.shape, dtype=dtype)
    return out
