"""Opt-in fast math (`[device] math = "bf16"`, NOT bit-exact): prefill matmuls on bf16 dot products.

Off ("exact"), every matmul is the exact fp32 path. On, CPU matmuls of at least `MIN_ROWS` token rows
on stored weights (GGUF blocks, bf16/fp16, row-int8, MXFP4) run fast_cpu.cpp: weights decoded exactly
per tile and rounded to bf16, activations rounded to bf16, sums in fp32. Steps of fewer rows (one
stream's decode) stay exact; a step batching 16+ sequences' rows takes bf16 too. The logits drift: tests/bench/bench_fast_math.py measures by how much (RESULTS.md).
"""

from __future__ import annotations

import torch

from deltafind.models.ops.cpu_kernels import CPU

MODES = ("exact", "bf16")
# Fewest token rows a matmul takes the bf16 kernel at: below it the exact kernels are as fast
# (tests/bench/RESULTS.md, "Fast math"), and decode keeps its exact logits.
MIN_ROWS = 16
_mode = (
    "exact"  # the process's mode: one model per worker process; `use` sets it when a model opens
)


def available() -> bool:
    """Whether the bf16 kernels are built here (a C++ compiler, and a CPU with AVX512-BF16)."""
    lib = CPU.load()
    return lib is not None and lib.df_fast_ok() == 1


def use(mode: str) -> str:
    """Set the process's matmul mode; returns the mode in effect ("exact" where bf16 is not available)."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"[device] math must be one of {', '.join(MODES)} (got {mode!r})")
    _mode = mode if mode == "exact" or available() else "exact"
    return _mode


def mode() -> str:
    """The matmul mode in effect: "exact" or "bf16"."""
    return _mode


def unavailable_note() -> str:
    """Why bf16 was asked for and is not in effect, for logs and status."""
    if CPU.load() is None:
        return f"[device] math = bf16 needs the CPU kernels, which are not built: {CPU.build_error}"
    return "[device] math = bf16 needs a CPU with AVX512-BF16 (/proc/cpuinfo avx512_bf16); math stays exact"


def takes(x: torch.Tensor) -> bool:
    """Whether a matmul of activations `x` [T, C] runs in bf16: bf16 mode, fp32 CPU x, T >= MIN_ROWS."""
    return (
        _mode == "bf16"
        and x.dim() == 2
        and x.shape[0] >= MIN_ROWS
        and x.dtype == torch.float32
        and x.device.type == "cpu"
    )


# Each exact kernel (stored_cpu.cpp, mxfp4_cpu.cpp) and its bf16 twin in fast_cpu.cpp: same arguments.
FAST = {
    "df_stored_parts": "df_fast_parts",
    "df_mxfp4_matmul": "df_fast_mxfp4",
    "df_mxfp4_gate_up_situ": "df_fast_mxfp4_gate_up_situ",
}


def run(x: torch.Tensor, exact: str, *args: object) -> int:
    """Call the CPU library's kernel `exact` on `args` (activations `x`), or first its bf16 twin where
    bf16 takes x; the twin refuses what it does not cover with a nonzero return. Returns the last
    kernel's return code (0: done)."""
    lib = CPU.load()
    rc = 1
    for name in (FAST[exact], exact) if takes(x) else (exact,):
        if (rc := getattr(lib, name)(*args)) == 0:
            break
    return rc
