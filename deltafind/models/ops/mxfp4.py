"""MXFP4 weights as compressed-tensors `mxfp4-pack-quantized` stores them (docs/kimi-k3-format.md §5).

A logical [R, C] matrix is `weight_packed` uint8 [R, C/2] (column 2j in the low
nibble of byte j, 2j+1 in the high one; E2M1 codes) plus `weight_scale` uint8
[R, C/32] (E8M0: 2^(s-127) per 32 input columns). Owns the exact decode, the
plain reference, and `mxfp4_linear`: fused CPU kernel or dequantise + matmul.
Off the CPU (CUDA, MPS) the dequantisation is torch ops into a reusable scratch
matrix, bit-identical to the C++ decode; `torch_path()` forces it on the CPU too.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from deltafind.models.ops import fast_math
from deltafind.models.ops.cpu_kernels import load_kernel

GROUP = 32
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def logical_shape(packed: torch.Tensor) -> tuple[int, int]:
    return packed.shape[0], packed.shape[1] * 2


def check_pack(packed: torch.Tensor, scale: torch.Tensor) -> None:
    """Raise ValueError unless packed/scale are a well-formed MXFP4 pair."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"MXFP4 tensors must be uint8 (got {packed.dtype}, {scale.dtype})")
    rows, cols = logical_shape(packed)
    if packed.dim() != 2 or cols % GROUP or tuple(scale.shape) != (rows, cols // GROUP):
        raise ValueError(
            f"MXFP4 shapes do not fit: packed {tuple(packed.shape)}, scale {tuple(scale.shape)}"
        )


def check_scales(scale: torch.Tensor) -> None:
    """E8M0 bytes 0 and 255 are outside what K3 uses (0 would be 2^-127, 255 inf/NaN): refuse them."""
    if scale.numel() and (bool((scale == 0).any()) or bool((scale == 255).any())):
        raise ValueError(
            "MXFP4 scale byte 0 or 255 found; the checkpoint's scales lie strictly inside (0, 255)"
        )


def dequantize_reference(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The plain, obviously-exact decode to fp32 [R, C] (docs/kimi-k3-format.md §5.2's sketch)."""
    table = torch.tensor(E2M1, dtype=torch.float32, device=packed.device)
    lo, hi = (packed & 0xF).long(), (packed >> 4).long()
    codes = torch.stack([lo, hi], dim=-1).flatten(-2)  # [R, C], low nibble first
    factor = torch.exp2(scale.to(torch.float32) - 127.0)  # [R, C/32]
    return table[codes] * factor.repeat_interleave(GROUP, dim=-1)


_force_torch = False  # set by `torch_path()`
_tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
_local = threading.local()


@contextlib.contextmanager
def torch_path() -> Iterator[None]:
    """Run every MXFP4 op through the torch (device) path, also on the CPU: for exactness tests and benches."""
    global _force_torch
    old, _force_torch = _force_torch, True
    try:
        yield
    finally:
        _force_torch = old


def _kernel_ok(x: torch.Tensor, packed: torch.Tensor) -> bool:
    return (
        not _force_torch
        and x.device.type == "cpu"
        and packed.device.type == "cpu"
        and load_kernel() is not None
    )


def _device_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """E2M1 values [16] and 2^(s-127) for every E8M0 byte [256], fp32, on `device` (made exactly on the CPU)."""
    tables = _tables.get(device)
    if tables is None:
        pow2 = torch.tensor(
            [math.ldexp(1.0, s - 127) for s in range(256)], dtype=torch.float32
        )  # 255 -> inf, as in C++
        tables = _tables[device] = (
            torch.tensor(E2M1, dtype=torch.float32).to(device),
            pow2.to(device),
        )
    return tables


def scratch(device: torch.device, rows: int, cols: int) -> torch.Tensor:
    """A reusable fp32 [rows, cols] matrix for this thread and device (contents undefined).

    Safe to reuse call after call: on the CPU calls are sequential, on a GPU the
    next write is queued on the same stream after the matmul that reads it.
    """
    bufs: dict[torch.device, torch.Tensor] = _local.__dict__.setdefault("bufs", {})
    buf = bufs.get(device)
    if buf is None or buf.numel() < rows * cols:
        # a normal tensor even when first made under inference_mode: it is written in either mode
        with torch.inference_mode(False):
            buf = bufs[device] = torch.empty(rows * cols, dtype=torch.float32, device=device)
    return buf[: rows * cols].view(rows, cols)


def dequantize_torch(
    packed: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Exact fp32 [R, C] with torch ops on packed's device (CPU, CUDA, MPS), written into `out` if given.

    Each weight is one table value times one power of two, both exact in fp32,
    so the product is exact: the same bits as the C++ decode and the reference.
    """
    check_pack(packed, scale)
    rows, cols = logical_shape(packed)
    e2m1, pow2 = _device_tables(packed.device)
    out = (
        torch.empty((rows, cols), dtype=torch.float32, device=packed.device) if out is None else out
    )
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1)  # [R, C/2, 2] uint8, low nibble first
    torch.index_select(e2m1, 0, codes.view(-1).int(), out=out.view(-1))
    factor = pow2.index_select(0, scale.reshape(-1).int()).view(
        rows, cols // GROUP, 1
    )  # [R, C/32, 1]
    out.view(rows, cols // GROUP, GROUP).mul_(factor)
    return out


def _dequant_expr(
    packed: torch.Tensor, scale: torch.Tensor, e2m1: torch.Tensor, pow2: torch.Tensor
) -> torch.Tensor:
    """The decode as one expression, for torch.compile to fuse into a single kernel (same exact products)."""
    codes = (
        torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1).long()
    )  # [R, C]
    return e2m1[codes] * pow2[scale.long()].repeat_interleave(GROUP, dim=-1)


_compiled: dict[str, object] = {}


def use_compile(enabled: bool) -> None:
    """torch.compile the off-CPU dequantisation ([device] compile). Off by default: whether one fused
    kernel beats five torch ops has not been measured (tests/gpu/bench_gpu.py measures it)."""
    if enabled and "dequant" not in _compiled:
        _compiled["dequant"] = torch.compile(_dequant_expr, dynamic=True)
    elif not enabled:
        _compiled.pop("dequant", None)


def dequantize(
    packed: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Exact fp32 [R, C]; the C++ kernel where it is built, else torch ops (any device)."""
    check_pack(packed, scale)
    rows, cols = logical_shape(packed)
    if not _kernel_ok(packed, packed):
        return dequantize_torch(packed, scale, out)
    packed, scale = packed.contiguous(), scale.contiguous()
    out = torch.empty((rows, cols), dtype=torch.float32) if out is None else out
    rc = load_kernel().df_mxfp4_dequant(
        packed.data_ptr(), scale.data_ptr(), rows, cols, out.data_ptr(), torch.get_num_threads()
    )
    assert rc == 0
    return out


def fused_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [T, C] fp32 -> [T, R] through the fused kernel (no weight is materialised).

    Per output: fp32 lanes of FMAs (8, or 32 on AVX-512), group by group, then one fixed tree; the
    result does not depend on T or on the thread count.
    """
    rows, cols = logical_shape(packed)
    x = x.contiguous()
    packed, scale = packed.contiguous(), scale.contiguous()
    y = torch.empty((x.shape[0], rows), dtype=torch.float32)
    rc = fast_math.run(  # bf16 products where the opt-in `[device] math = "bf16"` takes x
        x,
        "df_mxfp4_matmul",
        x.data_ptr(),
        x.shape[0],
        cols,
        packed.data_ptr(),
        scale.data_ptr(),
        rows,
        cols,
        y.data_ptr(),
        rows,
        torch.get_num_threads(),
    )
    assert rc == 0
    return y


def fused_gate_up_situ(
    x: torch.Tensor,
    w1: tuple[torch.Tensor, torch.Tensor],
    w3: tuple[torch.Tensor, torch.Tensor],
    beta: float,
    linear_beta: float,
) -> torch.Tensor:
    """situ(x @ W1.T, x @ W3.T) in one kernel call: x [T, C] fp32 -> [T, R] (bf16 products where
    `[device] math = "bf16"` takes these rows: fast_math.py)."""
    rows, cols = logical_shape(w1[0])
    x = x.contiguous()
    (p1, s1), (p3, s3) = ((p.contiguous(), s.contiguous()) for p, s in (w1, w3))
    h = torch.empty((x.shape[0], rows), dtype=torch.float32)
    rc = fast_math.run(
        x,
        "df_mxfp4_gate_up_situ",
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
    assert rc == 0
    return h


def can_fuse(x: torch.Tensor, packed: torch.Tensor) -> bool:
    """Whether a routed expert's gate and up take one kernel call (`fused_gate_up_situ`) for x."""
    return _kernel_ok(x, packed)


def mxfp4_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
) -> torch.Tensor:
    """`x @ W.T` for an MXFP4 W, fp32 in and out. x [T, C] -> [T, R].

    On a CPU with the kernel, the fused kernel at every T, so a token's row has the same bits in any
    batch (prefix reuse and chunking never change a result). A dequantisation plus one BLAS matmul
    would be ~12 % faster at 512+ tokens an expert (one Zen 4 core: 83 vs 73 GFLOP/s; equal at 256)
    but sums in another order. Elsewhere: exact dequantisation to fp32, then one matmul.
    """
    check_pack(packed, scale)
    if x.dtype != torch.float32:
        raise ValueError(f"MXFP4 matmul takes fp32 activations (got {x.dtype})")
    if _kernel_ok(x, packed):
        return fused_linear(x, packed, scale)
    fused = _compiled.get("dequant")
    if fused is not None and packed.device.type != "cpu":
        return F.linear(x, fused(packed, scale, *_device_tables(packed.device)))  # type: ignore[operator]
    # Dequantise into a reused scratch matrix: no 4-bytes-per-weight allocation (and page faults) per call.
    return F.linear(x, dequantize(packed, scale, scratch(packed.device, *logical_shape(packed))))
