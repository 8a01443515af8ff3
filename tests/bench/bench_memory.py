"""Memory of weights kept as stored: peak RSS growth over what the store says it needs.

For each store, in fresh subprocesses (alternating), open the model with a fixed expert cache
budget, generate a few tokens, and report peak RSS growth (VmHWM minus the RSS after importing
torch and deltafind, which is reported apart as the runtime) divided by the stored bytes of the
resident spine plus the expert cache budget. `stored` is the default path (bf16 weights stay
bf16); `widened` opens under `stored.widened()` (every weight widened to fp32, the old path).

Stores: a bf16 Qwen3-MoE with a wide spine (vocab 32k, hidden 3072, 4 layers: 0.6 GB), and with
`--k3` a Kimi K3 store of the real hidden size (7168) with few heads, layers and experts.

    python tests/bench/bench_memory.py --root /tmp/dfmem [--rounds 2] [--cache-mib 256] [--k3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

QWEN_WIDE = {
    "vocab": 32000,
    "hidden": 3072,
    "heads": 24,
    "kv_heads": 8,
    "head_dim": 128,
    "layers": 4,
    "inter": 8192,
    "experts": 16,
    "top_k": 4,
    "moe_inter": 1024,
    "dense_layers": set(),
}
K3_WIDE = {"layers": 2, "mla": [2], "experts": 16, "heads": 8, "kda_heads": 8, "inter": 4096}


def make_store(root: Path, family: str) -> Path:
    import deltafind.importer.synthetic_families  # noqa: F401 - registers the families
    from deltafind.importer.setup import setup_store
    from deltafind.importer.synthetic import FAMILIES, open_synthetic

    store = root / family
    if not (store / "manifest.json").exists():
        fam = FAMILIES[family]
        if family == "qwen3_moe":
            fam.shapes["mem"] = {**fam.shapes["tiny"], **QWEN_WIDE}
        else:
            fam.shapes["mem"] = {**fam.shapes["full-layer"], **K3_WIDE}
        from deltafind.models.registry import family_module

        names = family_module(family).weight_names(
            None
        )  # synthetic stores need only the family's patterns
        setup_store(
            open_synthetic(family, "mem", 0),
            store,
            [root / f"{family}-d0"],
            dense_slices=4,
            progress=False,
            names=names,
        )
    return store


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    return 0


def child(store: str, mode: str, cache_bytes: int, tokens: int) -> None:
    import torch

    from deltafind import Model
    from deltafind.models.ops.stored import widened
    from deltafind.store.manifest import SPINE_NAME
    from deltafind.store.spine import read_layout

    runtime = _status("VmRSS:")
    if mode == "widened":
        with widened():
            model = Model.open(store, expert_bytes=cache_bytes)
    else:
        model = Model.open(store, expert_bytes=cache_bytes)
    ids = model.tokenizer.encode("Once upon a time") or [1]
    model.generate(ids, max_new_tokens=tokens)
    spine_stored = sum(t.nbytes for t in read_layout(Path(store) / SPINE_NAME, torch.float32))
    held = sum(p.numel() * p.element_size() for p in model.net.parameters())
    peak = _status("VmHWM:")
    model.close()
    print(
        json.dumps(
            {
                "mode": mode,
                "runtime_rss_bytes": runtime,
                "peak_rss_bytes": peak,
                "growth_bytes": peak - runtime,
                "spine_stored_bytes": spine_stored,
                "spine_held_bytes": held,
                "cache_budget_bytes": cache_bytes,
                "ratio": (peak - runtime) / (spine_stored + cache_bytes),
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cache-mib", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument(
        "--k3",
        action="store_true",
        help="also a Kimi K3 store of the real hidden size 7168 (small vocabulary: ~0.5 GiB spine)",
    )
    ap.add_argument("--child", nargs=2, metavar=("STORE", "MODE"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a.child[0], a.child[1], a.cache_mib << 20, a.tokens)
        return
    a.root.mkdir(parents=True, exist_ok=True)
    for family in ["qwen3_moe", *(["kimi_k3"] if a.k3 else [])]:
        store = make_store(a.root, family)
        rows: dict[str, list[dict]] = {"stored": [], "widened": []}
        for _ in range(a.rounds):
            for mode in rows:
                out = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--root",
                        str(a.root),
                        "--cache-mib",
                        str(a.cache_mib),
                        "--tokens",
                        str(a.tokens),
                        "--child",
                        str(store),
                        mode,
                    ],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                rows[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
        summary = {
            mode: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "mode"}
            for mode, rs in rows.items()
        }
        print(json.dumps({"bench": "memory", "family": family, **summary}))
        s, w = summary["stored"], summary["widened"]
        print(
            f"{family}: spine stored {s['spine_stored_bytes'] / 2**30:.2f} GiB, cache {a.cache_mib} MiB, "
            f"runtime {s['runtime_rss_bytes'] / 2**30:.2f} GiB apart | growth / (spine + cache): "
            f"stored {s['ratio']:.2f}, widened {w['ratio']:.2f} (goal <= 1.15)"
        )


if __name__ == "__main__":
    main()
