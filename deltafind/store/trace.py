"""Router trace: an opt-in, buffered, size-bounded JSONL log of expert routes and predictions.

One line per (sequence, position, layer): {"seq", "pos", "layer", "experts", "weights"};
prefetch predictions as {"layer", "pred"}. `summarize` reads a trace back:
hot experts, per-layer reuse between consecutive positions, prediction recall.
"""

from __future__ import annotations

import json
import threading
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from deltafind.log import get_logger

log = get_logger(__name__)


class TraceWriter:
    def __init__(self, path: Path, max_bytes: int = 256 << 20, flush_every: int = 512) -> None:
        self.path = Path(path)
        self.max_bytes, self.flush_every = max_bytes, flush_every
        self._f = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()
        self._buf: list[str] = []
        self.bytes = self.path.stat().st_size
        self.full = False
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        if self.full:
            return
        line = json.dumps(record, separators=(",", ":"))
        with self._lock:
            if self.bytes + len(line) + 1 > self.max_bytes:
                self.full = True
                log.warning("trace_full", path=str(self.path), max_bytes=self.max_bytes)
                return
            self._buf.append(line)
            self.bytes += len(line) + 1
            if len(self._buf) >= self.flush_every:
                self._flush()

    def routes(self, layer_idx: int, seqs: Sequence[int], positions: Sequence[int], ids: list[list[int]], weights: list[list[float]]) -> None:
        """One line per token t of a step: its sequence `seqs[t]` and position (-1 where unknown), the layer's experts and weights."""
        for t, (e, w) in enumerate(zip(ids, weights, strict=True)):
            self.write({"seq": seqs[t] if t < len(seqs) else -1, "pos": positions[t] if t < len(positions) else -1,
                        "layer": layer_idx, "experts": e, "weights": [round(x, 5) for x in w]})

    def _flush(self) -> None:
        if self._buf:
            self._f.write("\n".join(self._buf) + "\n")
            self._f.flush()
            self._buf.clear()

    def close(self) -> None:
        with self._lock:
            self._flush()
            self._f.close()


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
    counts: Counter[tuple[int, int]] = Counter()
    last: dict[tuple[int, int], set[int]] = {}
    reuse: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    recall: dict[int, list[int]] = defaultdict(lambda: [0, 0])
    pending_pred: dict[int, set[int]] = {}
    routes = 0
    for r in records:
        layer = r["layer"]
        if "pred" in r:
            pending_pred[layer] = set(r["pred"])
            continue
        routes += 1
        experts = set(r["experts"])
        for e in experts:
            counts[(layer, e)] += 1
        prev = last.get((r["seq"], layer))
        if prev is not None:
            reuse[layer][0] += len(prev & experts)
            reuse[layer][1] += len(experts)
        last[(r["seq"], layer)] = experts
        if layer in pending_pred:
            pred = pending_pred[layer]
            recall[layer][0] += len(pred & experts)
            recall[layer][1] += len(experts)
    return {
        "routes": routes,
        "distinct_experts": len(counts),
        "hot_experts": [{"layer": layer, "expert": e, "uses": n} for (layer, e), n in counts.most_common(top)],
        "reuse_by_layer": {layer: round(h / n, 4) for layer, (h, n) in sorted(reuse.items()) if n},
        "prediction_recall_by_layer": {layer: round(h / n, 4) for layer, (h, n) in sorted(recall.items()) if n},
    }


def heat_from_trace(records: list[dict[str, Any]]) -> Counter[tuple[int, int]]:
    counts: Counter[tuple[int, int]] = Counter()
    for r in records:
        if "experts" in r:
            for e in r["experts"]:
                counts[(r["layer"], e)] += 1
    return counts
