"""Logit drift of the opt-in row-int8 spine (`[cache] spine_int8`, docs/kimi-k3-drafting-io.md §9.6) against the spine as stored.

Row-int8 is NOT weight-exact: this prints how far it moves the model. For each store, the
same text is run teacher-forced through the store opened as stored and opened with
`spine_int8=True`; per position it compares the logits: max and mean |delta|, relative to
the logits' spread, KL(stored || int8) of the next-token distributions, and how often the
top-1 token agrees. Also the spine bytes each holds. One JSON line per store.

    python tests/bench/bench_int8_spine.py --root /tmp/dfint8 [--demo-store ~/.cache/deltafind/demo]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TEXT = (
    "The history of the printing press begins in the fifteenth century, when movable type made "
    "books cheaper to produce. Within fifty years, presses had spread across Europe, and the number "
    "of books in circulation grew from thousands to millions."
)


def k3_store(root: Path) -> Path:
    from deltafind.importer.setup import setup_store
    from deltafind.importer.synthetic import open_synthetic
    from deltafind.models import kimi_k3

    store = root / "k3-bench"
    if not (store / "manifest.json").exists():
        setup_store(
            open_synthetic("kimi_k3", "bench", 0),
            store,
            [root / "k3-bench-d0"],
            dense_slices=4,
            progress=False,
            names=kimi_k3.WEIGHTS,
        )
    return store


def drift(store: Path) -> dict:
    import torch

    from deltafind import Model

    out: dict = {"store": str(store)}
    logits = {}
    for mode in ("stored", "int8"):
        m = Model.open(store, expert_bytes=None, spine_int8=mode == "int8")
        try:
            ids = m.tokenizer.encode(TEXT)[:64]
            logits[mode] = m.forward_logits(ids)
            out[f"{mode}_spine_bytes"] = sum(
                p.numel() * p.element_size() for p in m.net.parameters() if p.device.type != "meta"
            )
        finally:
            m.close()
    a, b = logits["stored"], logits["int8"]
    delta = (a - b).abs()
    pa, lb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
    out.update(
        positions=a.shape[0],
        max_abs_delta=float(delta.max()),
        mean_abs_delta=float(delta.mean()),
        mean_abs_delta_over_logit_std=float(delta.mean() / a.std()),
        mean_kl=float((pa.exp() * (pa - lb)).sum(-1).mean()),
        top1_agreement=float((a.argmax(-1) == b.argmax(-1)).float().mean()),
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, required=True)
    ap.add_argument(
        "--demo-store", type=Path, default=Path.home() / ".cache" / "deltafind" / "demo"
    )
    a = ap.parse_args()
    a.root.mkdir(parents=True, exist_ok=True)
    stores = [
        *([a.demo_store] if (a.demo_store / "manifest.json").exists() else []),
        k3_store(a.root),
    ]
    for store in stores:
        print(json.dumps({"bench": "int8_spine", **drift(store)}), flush=True)


if __name__ == "__main__":
    main()
