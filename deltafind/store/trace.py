"""Router trace: an opt-in, buffered, size-bounded JSONL log of expert routes and predictions,
written by its own thread (never the engine's) into a file created new in the trace folder.

One line per (sequence, position, layer): {"seq", "pos", "layer", "experts", "weights"};
prefetch predictions as {"layer", "pred"}. `summarize` reads a trace back:
hot experts, per-layer reuse between consecutive positions, prediction recall.
"""

from __future__ import annotations

import json
import os
import threading
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from deltafind.errors import RequestError
from deltafind.log import get_logger

log = get_logger(__name__)


class TraceWriter:
    """Buffers trace lines from the engine thread; its own thread writes them, so a slow, full or failing
    file never stalls or fails a step: a write error stops the trace (`error`), logged, and generation goes on."""

    def __init__(
        self,
        path: Path,
        max_bytes: int = 256 << 20,
        flush_s: float = 0.5,
        *,
        fd: int | None = None,
        max_pending: int = 1 << 16,
    ) -> None:
        self.path = Path(path)
        self.max_bytes, self.flush_s, self.max_pending = max_bytes, flush_s, max_pending
        # Without `fd` (the Python API's own file), append; the daemon hands a file it created new.
        self._fd = (
            fd
            if fd is not None
            else os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        )
        self.bytes = os.fstat(self._fd).st_size
        self.full = False
        self.error: str | None = None
        self.dropped = 0  # lines the writer could not keep up with (bounded memory)
        self._pending: list[str] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="deltafind-trace", daemon=True)
        self._thread.start()

    @property
    def active(self) -> bool:
        return self.error is None and not self._closing

    def write(self, record: dict[str, Any]) -> None:
        if self.full or not self.active:
            return
        line = json.dumps(record, separators=(",", ":"))
        with self._lock:
            if self.bytes + len(line) + 1 > self.max_bytes:
                self.full = True
                log.warning("trace_full", path=str(self.path), max_bytes=self.max_bytes)
                return
            if len(self._pending) >= self.max_pending:
                self.dropped += 1
                return
            self._pending.append(line)
            self.bytes += len(line) + 1

    def routes(
        self,
        layer_idx: int,
        seqs: Sequence[int],
        positions: Sequence[int],
        ids: list[list[int]],
        weights: list[list[float]],
    ) -> None:
        """One line per token t of a step: its sequence `seqs[t]` and position (-1 where unknown), the layer's experts and weights."""
        for t, (e, w) in enumerate(zip(ids, weights, strict=True)):
            self.write(
                {
                    "seq": seqs[t] if t < len(seqs) else -1,
                    "pos": positions[t] if t < len(positions) else -1,
                    "layer": layer_idx,
                    "experts": e,
                    "weights": [round(x, 5) for x in w],
                }
            )

    def _run(self) -> None:
        while True:
            self._wake.wait(self.flush_s)
            self._wake.clear()
            with self._lock:
                lines, self._pending = self._pending, []
                closing = self._closing
            try:
                if lines:
                    data = ("\n".join(lines) + "\n").encode()
                    while data:
                        data = data[os.write(self._fd, data) :]
            except OSError as e:
                self.error = f"{self.path}: {e.strerror or e}"
                log.error(
                    "trace_write_failed",
                    path=str(self.path),
                    error=e.strerror or str(e),
                    action="trace stopped; generation goes on",
                )
                closing = True
            if closing:
                os.close(self._fd)
                return

    def close(self, wait_s: float = 5.0) -> None:
        """Stop: what is buffered is written by the trace's thread; wait up to `wait_s` for it (never on the engine thread)."""
        with self._lock:
            self._closing = True
        self._wake.set()
        if wait_s:
            self._thread.join(wait_s)


def open_trace_file(trace_dir: Path, name: str) -> tuple[int, Path]:
    """Create a new trace file `name` in `trace_dir` (made if missing): (fd, path), or a RequestError naming the fix.

    `name` is a file name, or a path whose folder is `trace_dir`. The file is created new (O_EXCL: an existing
    file, link, FIFO or device is refused, never appended to) relative to the opened folder (O_NOFOLLOW).
    """
    folder = Path(trace_dir).expanduser()
    fix = f"give a new file name; traces are written in [control] trace_dir ({folder})"
    given = Path(name)
    if len(given.parts) > 1 and os.path.realpath(given.parent) != os.path.realpath(folder):
        raise RequestError(f"{name}: outside the trace folder; {fix}", "path")
    base = given.name
    if base in ("", ".", "..") or base.startswith(".") or "\0" in base:
        raise RequestError(f"{name!r}: not a trace file name; {fix}", "path")
    try:
        folder.mkdir(mode=0o750, parents=True, exist_ok=True)
        dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise RequestError(
            f"{folder}: cannot use the trace folder ({e.strerror}); set [control] trace_dir to a "
            "folder the daemon can write",
            "path",
        ) from None
    try:
        fd = os.open(
            base,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o640,
            dir_fd=dir_fd,
        )
    except FileExistsError:
        raise RequestError(
            f"{folder / base}: exists; a trace is never written into an existing file: {fix}",
            "path",
        ) from None
    except OSError as e:
        raise RequestError(
            f"{folder / base}: cannot create ({e.strerror}); {fix}", "path"
        ) from None
    finally:
        os.close(dir_fd)
    return fd, folder / base


def read_trace(path: Path) -> list[dict[str, Any]]:
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a torn last line
    return out


def summarize(records: list[dict[str, Any]], top: int = 10) -> dict[str, Any]:
    """Hot experts, per-layer reuse (previous position's route recall) and prediction recall."""
    counts = heat_from_trace(records)
    last: dict[tuple[int, int], set[int]] = {}
    reuse: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    recall: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    pending_pred: dict[int, set[int]] = {}
    for r in records:
        layer = r["layer"]
        if "pred" in r:
            pending_pred[layer] = set(r["pred"])
            continue
        experts = set(r["experts"])
        prev = last.get((r["seq"], layer))
        if prev is not None:
            reuse[layer][0] += len(prev & experts)
            reuse[layer][1] += len(experts)
        last[(r["seq"], layer)] = experts
        if (pred := pending_pred.get(layer)) is not None:
            recall[layer][0] += len(pred & experts)
            recall[layer][1] += len(experts)
    return {
        "routes": sum("pred" not in r for r in records),
        "distinct_experts": len(counts),
        "hot_experts": [
            {"layer": layer, "expert": e, "uses": n} for (layer, e), n in counts.most_common(top)
        ],
        "reuse_by_layer": {layer: round(h / n, 4) for layer, (h, n) in sorted(reuse.items()) if n},
        "prediction_recall_by_layer": {
            layer: round(h / n, 4) for layer, (h, n) in sorted(recall.items()) if n
        },
    }


def heat_from_trace(records: list[dict[str, Any]]) -> Counter[tuple[int, int]]:
    return Counter((r["layer"], e) for r in records if "experts" in r for e in r["experts"])
