"""`setup_store` of one checkpoint with its records prepared inline (threads 0: load, lay out, hash,
then write, one record at a time) and on threads ahead of the writer, alternated round by round in
one process: the import rate side by side, as MB of the store per second and the ratio.

Not run in CI. The source is read from the page cache after the first round (every mode reads it
the same way); each round writes a fresh store under `--out` and deletes it, and drops nothing from
the cache. Prints ONE JSON line.

    python tests/bench/bench_import.py --from /tmp/dfmoe/qwen3moe-30b-a3b-8l-q4_k_m.gguf \
        [--threads 0,2] [--rounds 3] [--out /tmp/bench-import] [--accept-llamacpp-k3]

A Kimi K3 GGUF (`--accept-llamacpp-k3`) also rewrites each expert's MXFP4 blocks at import: the
`bench`-shaped one tests/k3_gguf.py's `convert_k3(make_k3_hf(DIR, 0, "bench"), FILE, "bf16")` writes
(3.6 GB, 192 real-width experts) shows that case.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from", dest="source", required=True, help="a GGUF file or HF folder")
    ap.add_argument("--threads", default="0,2", help="preparing threads of each mode (0: inline)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="/tmp/bench-import")
    ap.add_argument("--accept-llamacpp-k3", action="store_true", help="as `deltafind setup`'s flag")
    args = ap.parse_args()

    from deltafind.importer.checkpoint import open_source
    from deltafind.importer.gguf_source import GGUFOptions
    from deltafind.importer.setup import setup_store
    from deltafind.models.registry import family_module

    modes = [int(t) for t in args.threads.split(",")]
    options = GGUFOptions(llamacpp_k3=args.accept_llamacpp_k3)
    config = open_source(Path(args.source), options).config
    family = family_module(config["model_type"])
    names = family.weight_names(family.ModelArgs.from_config(config))
    seconds: dict[int, list[float]] = {m: [] for m in modes}
    size = 0
    for r in range(args.rounds):
        for m in modes if r % 2 == 0 else modes[::-1]:
            store = Path(args.out) / f"t{m}"
            shutil.rmtree(store, ignore_errors=True)
            t0 = time.perf_counter()
            source = open_source(Path(args.source), options)  # timed: setup opens it too
            setup_store(source, store, progress=False, names=names, threads=m)
            seconds[m].append(time.perf_counter() - t0)
            size = sum(p.stat().st_size for p in store.rglob("*") if p.is_file())
            shutil.rmtree(store)
    med = {m: statistics.median(s) for m, s in seconds.items()}
    base = med[modes[0]]
    print(
        json.dumps(
            {
                "source": args.source,
                "cpu": platform.processor() or platform.machine(),
                "store_mb": round(size / 1e6, 1),
                "seconds": {str(m): [round(x, 2) for x in s] for m, s in seconds.items()},
                "mb_per_s": {str(m): round(size / 1e6 / v, 1) for m, v in med.items()},
                "speedup_vs_first": {str(m): round(base / v, 3) for m, v in med.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
