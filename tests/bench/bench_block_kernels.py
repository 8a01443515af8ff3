"""One-token matmul per stored format: this CPU's kernel build against its AVX2 build, side by side.

Not run in CI. On an AVX-512 CPU the default build decodes GGUF blocks and MXFP4 packs by table
(stored_blocks.h row512, mxfp4_cpu.cpp rows512); the AVX2 build ("-mno-avx512f", the code every other
x86 CPU runs) computes the factored form. Each matrix is timed through `df_stored_parts` /
`df_mxfp4_matmul` at each thread count, the builds alternating in blocks of back-to-back calls,
medians over rounds. The matrix stays in L2/L3 unless `--rows` makes it larger: this is the
instruction cost of the format, the memory-bound demo is bench_demo_vs_llamacpp.py's. Prints ONE
JSON line: per format and thread count, microseconds per call for each build and `speedup`
(AVX2 time / default time).

    python tests/bench/bench_block_kernels.py [--rows 2048] [--cols 2048] [--rounds 9]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from deltafind.models.ops.cpu_kernels import CPU, StoredPart
from deltafind.models.ops.stored_weight import KINDS
from tests.conftest import avx2_kernels, gguf_blocks

FORMATS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4"]


def _call(kind: str, rows: int, cols: int):  # -> (lib, threads) -> None
    x, y = torch.randn(1, cols), torch.empty(1, rows)
    if kind == "MXFP4":
        packed = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8)
        scale = torch.randint(118, 127, (rows, cols // 32), dtype=torch.uint8)
        return lambda lib, n: lib.df_mxfp4_matmul(
            x.data_ptr(),
            1,
            cols,
            packed.data_ptr(),
            scale.data_ptr(),
            rows,
            cols,
            y.data_ptr(),
            rows,
            n,
        )
    w = gguf_blocks(kind, rows, cols)
    part = (StoredPart * 1)(StoredPart(KINDS[kind], rows, cols, w.shape[1], w.data_ptr()))
    return lambda lib, n, w=w: lib.df_stored_parts(
        part, 1, 0, x.data_ptr(), 1, cols, y.data_ptr(), rows, n
    )  # w: the part points into it


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--block", type=int, default=20, help="back-to-back calls per timing")
    args = ap.parse_args()
    builds = {"default": CPU.load(), "avx2": avx2_kernels().load()}
    if None in builds.values():
        raise SystemExit(f"a kernel build failed: {CPU.build_error or avx2_kernels().build_error}")
    threads = list(range(1, len(os.sched_getaffinity(0)) + 1))
    out: dict = {
        "bench": "block_kernels",
        "rows": args.rows,
        "cols": args.cols,
        "threads": threads,
        "formats": {},
        "avx512": "avx512f" in Path("/proc/cpuinfo").read_text()
        if Path("/proc/cpuinfo").exists()
        else None,
    }
    for kind in FORMATS:
        call = _call(kind, args.rows, args.cols)
        times: dict[tuple[str, int], list[float]] = {(b, n): [] for b in builds for n in threads}
        for r in range(args.rounds):
            for n in threads:
                for b in builds if r % 2 == 0 else reversed(list(builds)):
                    call(builds[b], n)
                    t = time.perf_counter()
                    for _ in range(args.block):
                        call(builds[b], n)
                    times[(b, n)].append((time.perf_counter() - t) / args.block * 1e6)
        row = {}
        for n in threads:
            d, a = statistics.median(times[("default", n)]), statistics.median(times[("avx2", n)])
            row[f"threads_{n}"] = {
                "default_us": round(d, 1),
                "avx2_us": round(a, 1),
                "speedup": round(a / d, 3),
            }
        out["formats"][kind] = row
        print(kind, row, file=sys.stderr, flush=True)
    out["loadavg"] = [round(v, 2) for v in os.getloadavg()]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
