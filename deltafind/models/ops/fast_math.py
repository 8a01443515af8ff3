"""Opt-in fast math (`[device] math`, NOT bit-exact): "bf16" prefill matmuls, or "q8", llama.cpp's arithmetic.

Off ("exact"), every matmul is the exact fp32 path. "bf16": CPU matmuls of at least `MIN_ROWS` token rows
on stored weights (GGUF blocks, bf16/fp16, row-int8, MXFP4) run fast_cpu.cpp: weights decoded exactly per
tile and rounded to bf16, activations rounded to bf16, sums in fp32; smaller steps stay exact. "q8": every
matmul on Q4_K/Q5_K/Q6_K/Q8_0 weights, at any row count, quantizes x to llama.cpp's Q8_K/Q8_0 and takes
integer dot products (q8_cpu.cpp, stored_q8.h); other kinds stay exact. docs/math-modes.md says how far
the logits drift (tests/bench/bench_fast_math.py, bench_moe_vs_llamacpp.py measure it).
"""

from __future__ import annotations

import torch

from deltafind.models.ops.cpu_kernels import CPU

MODES = ("exact", "bf16", "q8")  # index = df_set_math's code (q8_cpu.cpp)
# Fewest token rows a matmul takes the bf16 kernel at: below it the exact kernels are as fast
# (tests/bench/RESULTS.md, "Fast math"), and decode keeps its exact logits.
MIN_ROWS = 16
_mode = (
    "exact"  # the process's mode: one model per worker process; `use` sets it when a model opens
)


def available(mode: str = "bf16") -> bool:
    """Whether `mode`'s kernels are built here: bf16 needs a C++ compiler and a CPU with AVX512-BF16;
    q8 only the compiler (its integer dot products have AVX2 and scalar forms)."""
    lib = CPU.load()
    return lib is not None and (mode != "bf16" or lib.df_fast_ok() == 1)


def use(mode: str) -> str:
    """Set the process's matmul mode; returns the mode in effect ("exact" where `mode` is not available)."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"[device] math must be one of {', '.join(MODES)} (got {mode!r})")
    _mode = mode if mode == "exact" or available(mode) else "exact"
    if (lib := CPU.load()) is not None:
        lib.df_set_math(MODES.index(_mode))  # the layer kernels' matmuls read it in C
    return _mode


def mode() -> str:
    """The matmul mode in effect: one of MODES."""
    return _mode


def unavailable_note(mode: str = "bf16") -> str:
    """Why `mode` was asked for and is not in effect, for logs and status."""
    if CPU.load() is None:
        return (
            f"[device] math = {mode} needs the CPU kernels, which are not built: {CPU.build_error}"
        )
    return "[device] math = bf16 needs a CPU with AVX512-BF16 (/proc/cpuinfo avx512_bf16); math stays exact"


def describe(mode: str) -> str:
    """What a non-exact mode computes, one clause for logs and the status line (api.Model.snapshot's
    `math_note`, which `deltafinctl status` and `deltafind run --stats` print)."""
    if mode == "q8":
        return (
            "NOT bit-exact: matmuls on Q4_K/Q5_K/Q6_K/Q8_0 weights use llama.cpp's int8 dot products "
            "(x rounded to Q8_K/Q8_0 blocks), at every token count"
        )
    return "NOT bit-exact: matmuls of 16+ token rows use bf16 dot products"


def status_note(requested: str) -> str:
    """The status line's clause: what the mode in effect computes, or why `requested` is not in effect
    ("" where both are exact)."""
    if _mode != "exact":
        return describe(_mode)
    return unavailable_note(requested) if requested != "exact" else ""


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
