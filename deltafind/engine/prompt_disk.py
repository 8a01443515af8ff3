"""Prompt state on a drive: prefix-cache entries written as safetensors, read back after a restart.

Each file holds one entry (its token ids, attention K/V, KDA/conv state at its end and at its
snapshots) and a key over what must not change under it (`identity`: model, store manifest,
chat template, dtype) plus the format version and a checksum of every tensor. A file whose
key or bytes do not match is deleted, never trusted. Writes run on a writer thread; the files
are bounded in bytes, least recently used first to go. Token ids and tensors only.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from deltafind.engine.prefix_cache import Entry, is_recurrent
from deltafind.log import get_logger
from deltafind.models.ops.batch import LayerCache, SequenceCache
from deltafind.models.ops.kda_layer import KDAState

log = get_logger(__name__)
FORMAT = "1"
SUFFIX = ".prompt.safetensors"
QUEUE = 4  # entries waiting to be written; more are skipped (the next turn writes a superset)


def identity_key(identity: dict[str, str]) -> str:
    """The key a file must carry to be read: a hash of the format and everything in `identity`."""
    return hashlib.sha256(
        json.dumps({"format": FORMAT, **identity}, sort_keys=True).encode()
    ).hexdigest()


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _state_tensors(prefix: str, st: KDAState) -> dict[str, torch.Tensor]:
    out = {f"{prefix}.conv{j}": c for j, c in enumerate(st.conv) if c is not None}
    if st.recurrent is not None:
        out[f"{prefix}.S"] = st.recurrent
    return out


def _state(tensors: dict[str, torch.Tensor], prefix: str, length: int) -> KDAState:
    st = KDAState()
    st.conv = [tensors.get(f"{prefix}.conv{j}") for j in range(3)]
    st.recurrent = tensors.get(f"{prefix}.S")
    st.length = st.window_start = length
    return st


@dataclass
class _File:
    path: Path
    tokens: np.ndarray
    positions: tuple[int, ...]  # where recurrent state is held besides the end
    recurrent: bool
    nbytes: int

    def usable(self, shared: int) -> int:
        if shared >= len(self.tokens):
            return len(self.tokens)
        if not self.recurrent:
            return shared
        return max((p for p in self.positions if p <= shared), default=0)


class PromptDisk:
    """The prompt-state files of one store in `directory`, within `max_bytes`."""

    def __init__(
        self,
        directory: Path,
        max_bytes: int,
        identity: dict[str, str],
        device: torch.device | str = "cpu",
    ) -> None:
        self.dir, self.max_bytes, self.key = Path(directory), max_bytes, identity_key(identity)
        self.device = torch.device(device)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._files: OrderedDict[Path, _File] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[np.ndarray, list[Any], dict[int, list[Any]]]] = queue.Queue(
            QUEUE
        )
        self.loads = self.writes = self.dropped = 0
        self._scan()
        self._writer = threading.Thread(
            target=self._write_loop, name="deltafind-prompt-disk", daemon=True
        )
        self._writer.start()

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(f.nbytes for f in self._files.values())

    def __len__(self) -> int:
        return len(self._files)

    # -- reading ---------------------------------------------------------------

    def _scan(self) -> None:
        found = []
        for path in self.dir.glob(f"*{SUFFIX}"):
            try:
                with safe_open(str(path), framework="pt") as f:
                    meta = f.metadata() or {}
                    if meta.get("format") != FORMAT or meta.get("identity") != self.key:
                        self._drop(
                            path, "stale: written for another model, store, chat template or format"
                        )
                        continue
                    tokens = f.get_tensor("tokens").numpy()
                found.append(
                    (
                        path.stat().st_mtime,
                        _File(
                            path,
                            tokens,
                            tuple(json.loads(meta["positions"])),
                            meta["recurrent"] == "1",
                            path.stat().st_size,
                        ),
                    )
                )
            except Exception as e:  # a torn or foreign file: not ours to trust
                self._drop(path, f"unreadable: {type(e).__name__}: {e}")
        for _, f in sorted(found, key=lambda x: x[0]):
            self._files[f.path] = f
        self._evict()
        log.info(
            "prompt_disk_opened",
            dir=str(self.dir),
            files=len(self._files),
            bytes=self.used_bytes,
            max_bytes=self.max_bytes,
        )

    def _drop(self, path: Path, reason: str) -> None:
        self.dropped += 1
        log.warning("prompt_disk_dropped", file=str(path), reason=reason)
        path.unlink(missing_ok=True)
        with self._lock:
            self._files.pop(path, None)

    def find(self, prompt: Sequence[int]) -> tuple[Path | None, int]:
        """The file the most of `prompt` can resume from, and how many tokens (< len(prompt))."""
        ids = np.asarray(prompt, dtype=np.int64)
        best, n = None, 0
        with self._lock:
            files = list(self._files.values())
        for f in files:
            k = min(len(f.tokens), len(ids))
            diff = np.flatnonzero(f.tokens[:k] != ids[:k])
            m = f.usable(min(int(diff[0]) if len(diff) else k, len(ids) - 1))
            if m > n:
                best, n = f.path, m
        return best, n

    def load(self, path: Path) -> Entry | None:
        """The entry in `path`, checked; None (and the file deleted, with a log line) if anything is off."""
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
            tensors = load_file(str(path))
        except Exception as e:
            self._drop(path, f"unreadable: {type(e).__name__}: {e}")
            return None
        if meta.get("format") != FORMAT or meta.get("identity") != self.key:
            self._drop(path, "stale: written for another model, store, chat template or format")
            return None
        if meta.get("checksum") != _checksum(tensors):
            self._drop(path, "checksum mismatch: the file's bytes changed")
            return None
        tokens = tensors.pop("tokens")
        n = len(tokens)
        tensors = {k: v.to(self.device) for k, v in tensors.items()}
        cache = SequenceCache(0)
        for i, kind in enumerate(json.loads(meta["layers"])):
            if kind == "kda":
                cache.layers.append(_state(tensors, f"end.{i}", n))
            else:
                layer = LayerCache()
                if kind:
                    layer.append(*(tensors[f"kv.{i}.{j}"] for j in range(kind)))
                cache.layers.append(layer)
        cache.length = n
        rec = [i for i, la in enumerate(cache.layers) if is_recurrent(la)]
        states = {
            p: [_state(tensors, f"at{p}.{i}", p) for i in rec]
            for p in json.loads(meta["positions"])
        }
        entry = Entry(tokens.numpy().astype(np.int64), cache, states)
        entry.count()
        with self._lock:
            if path in self._files:
                self._files.move_to_end(path)
        os.utime(path)  # LRU order survives a restart
        self.loads += 1
        log.info("prompt_disk_loaded", file=path.name, tokens=n, bytes=entry.nbytes)
        return entry

    # -- writing ---------------------------------------------------------------

    def save(self, entry: Entry) -> None:
        """Queue `entry` for writing (engine thread: what it holds is read by the writer, never changed)."""
        job = (entry.tokens.copy(), list(entry.cache.layers), dict(entry.states))
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            log.debug("prompt_disk_skipped", reason="writer busy", tokens=len(entry.tokens))

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until every queued entry is written (shutdown, tests); False if some still were not."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._queue.unfinished_tasks

    def _write_loop(self) -> None:
        while True:
            job = self._queue.get()
            try:
                self._write(*job)
            except Exception as e:  # a full or failing drive: the entry stays in memory only
                log.warning(
                    "prompt_disk_write_failed", dir=str(self.dir), error=f"{type(e).__name__}: {e}"
                )
            finally:
                self._queue.task_done()

    def _write(self, tokens: np.ndarray, layers: list[Any], states: dict[int, list[Any]]) -> None:
        n = len(tokens)
        tensors: dict[str, torch.Tensor] = {"tokens": torch.from_numpy(tokens.astype(np.int64))}
        kinds: list[Any] = []
        for i, layer in enumerate(layers):
            if is_recurrent(layer):
                kinds.append("kda")
                tensors.update(_state_tensors(f"end.{i}", layer))
            else:
                views = layer.view() if layer.length else ()
                kinds.append(len(views))
                tensors.update({f"kv.{i}.{j}": v[:n] for j, v in enumerate(views)})
        rec = [i for i, la in enumerate(layers) if is_recurrent(la)]
        for p, st in states.items():
            for i, s in zip(rec, st, strict=True):
                tensors.update(_state_tensors(f"at{p}.{i}", s))
        if sum(t.numel() * t.element_size() for t in tensors.values()) > self.max_bytes:
            return  # over the whole budget: not worth a write
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        meta = {
            "format": FORMAT,
            "identity": self.key,
            "layers": json.dumps(kinds),
            "positions": json.dumps(sorted(states)),
            "recurrent": "1" if rec else "0",
            "checksum": _checksum(tensors),
        }
        path = (
            self.dir
            / f"{hashlib.sha256(tokens.astype(np.int64).tobytes()).hexdigest()[:32]}{SUFFIX}"
        )
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        save_file(tensors, str(tmp), metadata=meta)
        size = tmp.stat().st_size
        if size > self.max_bytes:
            tmp.unlink()
            return
        os.replace(tmp, path)  # readers see the whole file or none
        new = _File(path, tokens, tuple(sorted(states)), bool(rec), size)
        with self._lock:
            self._files.pop(path, None)
            self._files[path] = new
            # a file this one extends, whose positions it holds too, is superseded
            gone = [
                f.path
                for f in self._files.values()
                if f.path != path
                and len(f.tokens) <= n
                and np.array_equal(f.tokens, tokens[: len(f.tokens)])
                and (not f.recurrent or {len(f.tokens), *f.positions} <= {n, *new.positions})
            ]
        for g in gone:
            g.unlink(missing_ok=True)
            with self._lock:
                self._files.pop(g, None)
        self.writes += 1
        self._evict()

    def _evict(self) -> None:
        while True:
            with self._lock:
                total = sum(f.nbytes for f in self._files.values())
                if total <= self.max_bytes or not self._files:
                    return
                path, _ = self._files.popitem(last=False)
            path.unlink(missing_ok=True)
