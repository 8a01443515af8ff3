"""One-token matmul per stored format: this CPU's kernel build against its AVX2 build, side by side.

Not run in CI. On an AVX-512 CPU the default build decodes GGUF blocks and MXFP4 packs by table
(stored_rows.h row512, mxfp4_cpu.cpp rows512); the AVX2 build ("-mno-avx512f", the code every
other x86 CPU runs) computes the factored form. Each matrix is timed through `df_stored_parts` /
`df_mxfp4_matmul` at each thread count, the builds alternating in blocks of back-to-back calls,
medians over rounds (one thread: its CPU time; more: wall time). The matrix stays in L2/L3 unless
`--rows` makes it larger: this is the instruction cost of the format, the memory-bound demo is
bench_demo_vs_llamacpp.py's. `--against DIR` adds a third build, the default one of another
checkout's kernel sources (e.g. `git worktree add DIR BASE`), and checks that it gives this
tree's results (bit for bit, or, where a kernel changed where fp32 rounds, to fp32 accuracy:
`against_same_bits` says which, `against_same_bits_q8` in q8 mode; `against_max_diff`: the largest
difference over the largest |y|). With `--math exact,q8` each build runs in each mode. Prints ONE
JSON line: per format and thread count, microseconds per call and GB/s of weights read for each build, `speedup` (AVX2 time / default time) and with
--against `vs_against` (its time / default time; `vs_against_q8` in q8 mode).

    python tests/bench/bench_block_kernels.py [--rows 2048] [--cols 2048] [--rounds 9]
        [--against DIR]
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

from deltafind.models.ops.cpu_kernels import CPU, SOURCES, KernelLibrary, StoredPart, _bind
from deltafind.models.ops.fast_math import MODES
from deltafind.models.ops.stored_weight import KINDS
from tests.conftest import avx2_kernels, gguf_blocks

FORMATS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4"]


def _against(root: str) -> KernelLibrary:
    """The default build of `root`'s kernel sources (its cache key hashes `root`'s headers)."""
    ops = Path(root) / "deltafind" / "models" / "ops"
    return KernelLibrary(tuple(str(ops / src) for src in SOURCES), _bind)


def _call(kind: str, rows: int, cols: int):  # -> ((lib, threads) -> None, output, bytes read)
    x, y = torch.randn(1, cols), torch.empty(1, rows)
    if kind == "MXFP4":
        packed = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8)
        scale = torch.randint(118, 127, (rows, cols // 32), dtype=torch.uint8)
        call = lambda lib, n: lib.df_mxfp4_matmul(  # noqa: E731
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
        return call, y, packed.numel() + scale.numel()
    w = gguf_blocks(kind, rows, cols)
    part = (StoredPart * 1)(StoredPart(KINDS[kind], rows, cols, w.shape[1], w.data_ptr()))
    call = lambda lib, n, w=w: lib.df_stored_parts(  # noqa: E731 (w: the part points into it)
        part, 1, 0, x.data_ptr(), 1, cols, y.data_ptr(), rows, n
    )
    return call, y, w.numel()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--block", type=int, default=20, help="back-to-back calls per timing")
    ap.add_argument("--against", default="", metavar="DIR", help="another checkout to time too")
    ap.add_argument(
        "--math", default="exact", help="[device] math modes to time: exact, q8 or exact,q8"
    )
    ap.add_argument(
        "--formats", default=",".join(FORMATS), help="comma-separated, of " + ",".join(FORMATS)
    )
    args = ap.parse_args()
    maths = args.math.split(",")
    if not set(maths) <= {"exact", "q8"}:
        raise SystemExit(f"--math takes exact and/or q8 (got {args.math!r})")
    libraries = {"default": CPU, "avx2": avx2_kernels()}
    if args.against:
        libraries["against"] = _against(args.against)
    builds = {name: lib.load() for name, lib in libraries.items()}
    for name, lib in libraries.items():
        if builds[name] is None:
            raise SystemExit(f"the {name} kernel build failed: {lib.build_error}")
    # (variant name, library, df_set_math code): a build in each mode asked for
    variants = {
        b if m == "exact" else f"{b}_{m}": (lib, MODES.index(m))
        for b, lib in builds.items()
        for m in maths
    }
    threads = list(range(1, len(os.sched_getaffinity(0)) + 1))
    out: dict = {
        "bench": "block_kernels",
        "rows": args.rows,
        "cols": args.cols,
        "threads": threads,
        "math": maths,
        "q8_simd": {0: "scalar", 1: "avx2", 2: "avx512vnni"}[builds["default"].df_q8_simd()],
        "formats": {},
        "avx512": "avx512f" in Path("/proc/cpuinfo").read_text()
        if Path("/proc/cpuinfo").exists()
        else None,
    }
    for kind in args.formats.split(","):
        call, y, nbytes = _call(kind, args.rows, args.cols)
        same_bits, rel_diff = {}, {}
        for m in maths if args.against else ():
            results = []
            for b in ("default", "against"):
                builds[b].df_set_math(MODES.index(m))
                call(builds[b], 1)
                builds[b].df_set_math(0)
                results.append(y.clone())
            # A kernel that changes only where fp32 rounds (e.g. the factored AVX2 form against an
            # exact decode) gives other bits but the same values to fp32 accuracy; anything else is
            # another computation, not a faster one.
            same_bits[m] = torch.equal(*results)
            scale = float(results[0].abs().max())
            rel_diff[m] = float((results[0] - results[1]).abs().max()) / scale
            if not torch.allclose(*results, rtol=1e-4, atol=1e-5 * scale):
                raise SystemExit(
                    f"{kind}: the --against build's {m} results differ from this tree's"
                )
        times: dict[tuple[str, int], list[float]] = {(v, n): [] for v in variants for n in threads}
        for r in range(args.rounds):
            for n in threads:
                # One thread runs on this one (the pool runs inline): its CPU time, so slices lost
                # to other processes on a shared machine do not count; more threads: wall time.
                clock = time.thread_time if n == 1 else time.perf_counter
                for v in variants if r % 2 == 0 else reversed(list(variants)):
                    lib, code = variants[v]
                    lib.df_set_math(code)
                    call(lib, n)
                    t = clock()
                    for _ in range(args.block):
                        call(lib, n)
                    times[(v, n)].append((clock() - t) / args.block * 1e6)
                    lib.df_set_math(0)
        row = {}
        for n in threads:
            med = {v: statistics.median(times[(v, n)]) for v in variants}
            cell = {f"{v}_us": round(t, 1) for v, t in med.items()}
            cell |= {f"{v}_gbps": round(nbytes / t / 1e3, 2) for v, t in med.items()}
            if "exact" in maths:
                cell["speedup"] = round(med["avx2"] / med["default"], 3)
            if set(maths) == {"exact", "q8"}:
                cell["q8_speedup"] = round(med["default"] / med["default_q8"], 3)
            if args.against:
                for m in maths:
                    sfx = "" if m == "exact" else f"_{m}"
                    cell[f"vs_against{sfx}"] = round(med[f"against{sfx}"] / med[f"default{sfx}"], 3)
                    cell[f"against_same_bits{sfx}"] = same_bits[m]
                    cell[f"against_max_diff{sfx}"] = rel_diff[m]  # over the largest |y|
            row[f"threads_{n}"] = cell
        out["formats"][kind] = row
        print(kind, row, file=sys.stderr, flush=True)
    out["loadavg"] = [round(v, 2) for v in os.getloadavg()]
    print(json.dumps(out))


if __name__ == "__main__":
    main()
