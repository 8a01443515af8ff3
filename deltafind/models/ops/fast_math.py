"""Opt-in fast math (`[device] math = "bf16"`, NOT bit-exact): prefill matmuls on bf16 dot products.

Off ("exact"), every matmul is the exact fp32 path. On, CPU matmuls of at least `MIN_ROWS` token rows
on stored weights (GGUF blocks, bf16/fp16, row-int8, MXFP4) run fast_cpu.cpp: weights decoded exactly
per tile and rounded to bf16, activations rounded to bf16, sums in fp32. Steps of fewer rows (one
stream's decode) stay exact; a step batching 16+ sequences' rows takes bf16 too. The logits drift: tests/bench/bench_fast_math.py measures by how much (RESULTS.md).
"""

from __future__ import annotations

import ctypes

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


def parts_matmul(
    parts: ctypes.Array, stack_cols: bool, x: torch.Tensor, out_cols: int
) -> torch.Tensor | None:
    """`df_stored_parts`'s matmul (stored.py) with bf16 products; None if the kernel refused."""
    y = torch.empty(x.shape[0], out_cols, dtype=torch.float32)
    rc = CPU.load().df_fast_parts(
        parts,
        len(parts),
        int(stack_cols),
        x.data_ptr(),
        x.shape[0],
        x.shape[1],
        y.data_ptr(),
        out_cols,
        torch.get_num_threads(),
    )
    return y if rc == 0 else None


def mxfp4_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    """x [T, C] fp32 @ W.T for an MXFP4 W (mxfp4.py's packed/scale) with bf16 products; None if refused."""
    x, packed, scale = x.contiguous(), packed.contiguous(), scale.contiguous()
    rows, cols = packed.shape[0], packed.shape[1] * 2
    y = torch.empty(x.shape[0], rows, dtype=torch.float32)
    rc = CPU.load().df_fast_mxfp4(
        x.data_ptr(),
        x.shape[0],
        x.shape[1],
        packed.data_ptr(),
        scale.data_ptr(),
        rows,
        cols,
        y.data_ptr(),
        rows,
        torch.get_num_threads(),
    )
    return y if rc == 0 else None


def mxfp4_gate_up_situ(
    x: torch.Tensor,
    w1: tuple[torch.Tensor, torch.Tensor],
    w3: tuple[torch.Tensor, torch.Tensor],
    beta: float,
    linear_beta: float,
) -> torch.Tensor | None:
    """situ(x @ W1.T, x @ W3.T) for MXFP4 W1, W3 (mxfp4.py's fused_gate_up_situ) with bf16 products."""
    x = x.contiguous()
    (p1, s1), (p3, s3) = ((p.contiguous(), s.contiguous()) for p, s in (w1, w3))
    rows, cols = p1.shape[0], p1.shape[1] * 2
    h = torch.empty(x.shape[0], rows, dtype=torch.float32)
    rc = CPU.load().df_fast_mxfp4_gate_up_situ(
        x.data_ptr(),
        x.shape[0],
        p1.data_ptr(),
        s1.data_ptr(),
        p3.data_ptr(),
        s3.data_ptr(),
        rows,
        cols,
        beta,
        linear_beta,
        h.data_ptr(),
        torch.get_num_threads(),
    )
    return h if rc == 0 else None
