"""Prefill matmuls against the CPU's fp32 FMA peak: GFLOP/s and % of peak per kernel at 1, 8, 64, 256 rows.

Not run in CI. The peak is computed, not assumed from a spec sheet: cores (this process's affinity) x
clock x fp32 FMA lanes per cycle x 2 FLOPs. Lanes come from /proc/cpuinfo's flags: AVX-512 -> 2 x 16
(two 512-bit FMA pipes, most Intel server cores), AVX2 -> 2 x 8; AMD family 25 (Zen 4) runs AVX-512 on
its two 256-bit pipes, so 2 x 8 there. The clock is MEASURED: a chain of dependent integer adds (one
per cycle on every x86 core since the P6) timed for ~50 ms. A second probe times 24 independent
AVX-512/AVX2 FMA chains, the throughput the lane assumption predicts, and prints both.

Kernels, on real K3 expert shapes (w1/w3: 3072 x 3584, w2: 3584 x 3072; bench_kimi_k3.py):
`df_mxfp4_matmul`, `df_mxfp4_gate_up_situ`, the GGUF block kernels Q4_K, Q6_K and Q8_0 and the bf16 spine
(`df_stored_parts`), and torch's fp32 `F.linear` (MKL/oneDNN) as a ceiling. Each point is the median
of `--rounds` timings; at one thread the timer is the thread's CPU time (a shared machine's lost time
slices do not count; its cache and memory contention still do), at more it is wall time. One JSON line
per point.

    python tests/bench/bench_kernels_peak.py [--rows 1,8,64,256] [--threads N] [--rounds 5] [--against DIR]

`--against DIR` builds DIR's kernel sources too and alternates the two builds round by round (the
before/after of a kernel change on a machine whose load moves); each line then names its `build`.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from deltafind.models.ops.cpu_kernels import CPU, SOURCES, KernelLibrary, StoredPart, _bind
from deltafind.models.ops.stored_weight import KINDS
from tests.conftest import gguf_blocks

PROBE = r"""
#include <immintrin.h>
#include <cstdint>
extern "C" void df_add_chain(int64_t n) {  // 8 dependent adds per iteration: n * 8 cycles
  int64_t a = 0;
  for (int64_t i = 0; i < n; ++i)
    asm volatile("add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\t"
                 "add $1, %0\n\tadd $1, %0\n\tadd $1, %0\n\tadd $1, %0" : "+r"(a));
}
#ifdef __AVX512F__
typedef __m512 V;
#define FMA _mm512_fmadd_ps
#define SET _mm512_set1_ps
#define ADD _mm512_add_ps
#define LANES 16
#else
typedef __m256 V;
#define FMA _mm256_fmadd_ps
#define SET _mm256_set1_ps
#define ADD _mm256_add_ps
#define LANES 8
#endif
extern "C" int df_fma_lanes() { return LANES; }
extern "C" float df_fma_chains(int64_t n) {  // 24 independent chains: n * 24 * LANES FMAs
  V a[24];
  const V m = SET(0.999999f), c = SET(1e-7f);
  for (int k = 0; k < 24; ++k) a[k] = SET(static_cast<float>(k));
  for (int64_t i = 0; i < n; ++i) {
#pragma GCC unroll 24
    for (int k = 0; k < 24; ++k) a[k] = FMA(a[k], m, c);  // unrolled: the chains live in registers
  }
  V s = a[0];
  for (int k = 1; k < 24; ++k) s = ADD(s, a[k]);
  float out[LANES];
  __builtin_memcpy(out, &s, sizeof(out));
  return out[0];
}
"""

K3 = {"w1": (3072, 3584), "w2": (3584, 3072)}  # (rows R, columns C) of one routed expert's matrices


def probe_lib() -> ctypes.CDLL:
    cxx = shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        raise SystemExit("the peak probe needs g++ or clang++")
    d = Path(tempfile.mkdtemp(prefix="df-peak-"))
    (d / "probe.cpp").write_text(PROBE)
    subprocess.run(
        [
            cxx,
            "-O3",
            "-march=native",
            "-shared",
            "-fPIC",
            str(d / "probe.cpp"),
            "-o",
            str(d / "probe.so"),
        ],
        check=True,
    )
    lib = ctypes.CDLL(str(d / "probe.so"))
    shutil.rmtree(d)  # loaded: the file is no longer needed
    lib.df_add_chain.argtypes = [ctypes.c_int64]
    lib.df_fma_chains.argtypes = [ctypes.c_int64]
    lib.df_fma_chains.restype = ctypes.c_float
    return lib


def cpu_flags() -> tuple[set[str], str, int | None]:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""

    def field(key: str) -> str:
        return next(
            (ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith(key)), ""
        )

    family = field("cpu family")
    return (
        set(field("flags").split()),
        field("model name") or field("vendor_id"),
        int(family) if family.isdigit() else None,
    )


def peak(lib: ctypes.CDLL, cores: int) -> dict:
    flags, model, family = cpu_flags()
    amd = "AMD" in model.upper() or "EPYC" in model.upper() or "RYZEN" in model.upper()
    if "avx512f" in flags and not (amd and family == 25):
        lanes, why = 2 * 16, "AVX-512: two 512-bit FMA pipes (2 x 16 fp32 lanes) per core"
    elif "avx512f" in flags:
        lanes, why = (
            2 * 8,
            "AMD family 25 (Zen 4): AVX-512 issued on two 256-bit FMA pipes (2 x 8 fp32 lanes) per core",
        )
    elif "fma" in flags:
        lanes, why = 2 * 8, "AVX2+FMA: two 256-bit FMA pipes (2 x 8 fp32 lanes) per core"
    else:
        lanes, why = 4, "no FMA flag: assumed one 128-bit pipe"
    ghz = []
    for _ in range(20):
        t = time.thread_time()
        lib.df_add_chain(2_000_000)
        ghz.append(16_000_000 / (time.thread_time() - t) / 1e9)
    clock = statistics.median(ghz)
    fma = []
    for _ in range(20):
        t = time.thread_time()
        lib.df_fma_chains(500_000)
        fma.append(500_000 * 24 * lib.df_fma_lanes() * 2 / (time.thread_time() - t) / 1e9)
    per_core = clock * lanes * 2
    return {
        "bench": "peak",
        "cpu": model,
        "family": family,
        "cores": cores,
        "clock_ghz_measured": round(clock, 3),
        "clock_method": "dependent integer add chain, this thread's CPU time, median of 20",
        "fma_lanes_per_cycle": lanes,
        "assumption": why,
        "peak_gflops_per_core": round(per_core, 1),
        "peak_gflops": round(per_core * cores, 1),
        "fma_probe_gflops_one_core": round(statistics.median(fma), 1),
        "fma_probe_vs_assumed": round(statistics.median(fma) / per_core, 3),
        "loadavg": [round(v, 2) for v in os.getloadavg()],
    }


def kernels(T: int, lib: ctypes.CDLL) -> dict[str, tuple[Callable[[int], object], float]]:
    """name -> (call(threads), FLOPs per call) through `lib`, every input made once (the same inputs for any lib)."""
    g = torch.Generator().manual_seed(T)
    out: dict[str, tuple[Callable[[int], object], float]] = {}
    for name, (R, C) in K3.items():
        x, y = torch.randn(T, C, generator=g), torch.empty(T, R)
        p = torch.randint(0, 256, (R, C // 2), dtype=torch.uint8, generator=g)
        s = torch.randint(118, 127, (R, C // 32), dtype=torch.uint8, generator=g)
        out[f"mxfp4_matmul_{name}"] = (
            lambda n, x=x, y=y, p=p, s=s, R=R, C=C: lib.df_mxfp4_matmul(
                x.data_ptr(), T, C, p.data_ptr(), s.data_ptr(), R, C, y.data_ptr(), R, n
            ),
            2.0 * T * R * C,
        )
    R, C = K3["w1"]
    x, h = torch.randn(T, C, generator=g), torch.empty(T, R)
    (p1, s1), (p3, s3) = (
        (
            torch.randint(0, 256, (R, C // 2), dtype=torch.uint8, generator=g),
            torch.randint(118, 127, (R, C // 32), dtype=torch.uint8, generator=g),
        )
        for _ in range(2)
    )
    out["mxfp4_gate_up_situ"] = (
        lambda n: lib.df_mxfp4_gate_up_situ(
            x.data_ptr(),
            T,
            p1.data_ptr(),
            s1.data_ptr(),
            p3.data_ptr(),
            s3.data_ptr(),
            R,
            C,
            4.0,
            25.0,
            h.data_ptr(),
            n,
        ),
        4.0 * T * R * C,
    )
    y = torch.empty(T, R)
    for kind in ("Q4_K", "Q6_K", "Q8_0", "BF16"):
        w = (
            (torch.randn(R, C, generator=g) * 0.05).bfloat16().view(torch.uint8)
            if kind == "BF16"
            else gguf_blocks(kind, R, C)
        )
        part = (StoredPart * 1)(StoredPart(KINDS[kind], R, C, w.shape[1], w.data_ptr()))
        out[f"stored_{kind.lower()}"] = (
            lambda n, part=part, w=w: lib.df_stored_parts(
                part, 1, 0, x.data_ptr(), T, C, y.data_ptr(), R, n
            ),
            2.0 * T * R * C,
        )
    wf = torch.randn(R, C, generator=g)

    def torch_fp32(n: int) -> object:
        torch.set_num_threads(n)
        return torch.nn.functional.linear(x, wf)

    out["torch_fp32_linear"] = (torch_fp32, 2.0 * T * R * C)
    return out


def builds(against: str) -> dict[str, ctypes.CDLL]:
    """This tree's kernel library, and with --against the same sources of another checkout built beside it."""
    out = {"this": CPU.load()}
    if against:
        ops = Path(against) / "deltafind" / "models" / "ops"
        out["against"] = KernelLibrary(tuple(str(ops / src) for src in SOURCES), _bind).load()
    for name, lib in out.items():
        if lib is None:
            raise SystemExit(f"the {name} kernels are not built: {CPU.build_error}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,64,256")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--only", default="", help="comma-separated kernel names (default: all)")
    ap.add_argument(
        "--against",
        default="",
        metavar="DIR",
        help="a checkout (e.g. `git worktree add DIR BASE`) whose kernels run "
        "interleaved with this tree's, round by round, so both see the same machine load",
    )
    args = ap.parse_args()
    libs = builds(args.against)
    info = peak(probe_lib(), args.threads)
    print(json.dumps(info), flush=True)
    only = set(filter(None, args.only.split(",")))
    for T in map(int, args.rows.split(",")):
        calls = {b: kernels(T, lib) for b, lib in libs.items()}
        for name, (_, flops) in calls["this"].items():
            if only and name not in only:
                continue
            # One thread: its CPU time, so time slices lost to other processes do not count; more: wall time.
            clock = time.thread_time if args.threads == 1 else time.perf_counter
            reps = max(
                1, int(2e9 // flops)
            )  # ~2 GFLOP a timing, so small T is not all call overhead
            times: dict[str, list[float]] = {b: [] for b in libs}
            for b in libs:
                calls[b][name][0](args.threads)  # warm: pages, pool threads
            for r in range(args.rounds):
                for b in libs if r % 2 == 0 else reversed(list(libs)):
                    call = calls[b][name][0]
                    t = clock()
                    for _ in range(reps):
                        rc = call(args.threads)
                    times[b].append((clock() - t) / reps)
                    assert not isinstance(rc, int) or rc == 0, f"{name} returned {rc}"
            for b, ts in times.items():
                med = statistics.median(ts)
                gflops = flops / med / 1e9
                print(
                    json.dumps(
                        {
                            "bench": "kernel",
                            "build": b,
                            "kernel": name,
                            "rows": T,
                            "threads": args.threads,
                            "ms": round(med * 1e3, 3),
                            "gflops": round(gflops, 2),
                            "pct_of_peak": round(100 * gflops / info["peak_gflops"], 1),
                            "rounds": args.rounds,
                            "timer": clock.__name__,
                            "loadavg": [round(v, 2) for v in os.getloadavg()],
                        }
                    ),
                    flush=True,
                )


if __name__ == "__main__":
    main()
