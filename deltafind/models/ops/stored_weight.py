"""A weight's stored format and its exact decode: `StoredWeight`, the kind table, gguf-py's grids.

The bytes of a bf16/fp16 matrix or of llama.cpp blocks (or row-int8), decoded to fp32 exactly as
the widened path decodes them (gguf-py's `dequantize` is the oracle); stored.py computes on them.
It knows no modules and no widened mode.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import numpy as np
import torch

from deltafind.models.ops.cpu_kernels import CPU
from deltafind.store.quant import BLOCKS as GGUF_BLOCKS
from deltafind.store.quant import parse_quant

# GGML type ids (gguf.GGMLQuantizationType): the kind codes stored_cpu.cpp takes.
# I8R (deltafind's own) is the row-int8 spine: per row an f16 scale, then int8 weights (docs/kimi-k3-drafting-io.md §9.6).
KINDS = {
    "F16": 1,
    "Q4_0": 2,
    "Q4_1": 3,
    "Q5_0": 6,
    "Q5_1": 7,
    "Q8_0": 8,
    "Q2_K": 10,
    "Q3_K": 11,
    "Q4_K": 12,
    "Q5_K": 13,
    "Q6_K": 14,
    "IQ2_XXS": 16,
    "IQ2_XS": 17,
    "IQ3_XXS": 18,
    "IQ1_S": 19,
    "IQ4_NL": 20,
    "IQ3_S": 21,
    "IQ2_S": 22,
    "IQ4_XS": 23,
    "IQ1_M": 29,
    "BF16": 30,
    "I8R": 100,
}
BLOCKS = {"F16": (1, 2), "BF16": (1, 2), **GGUF_BLOCKS}  # (weights, bytes) per block
TORCH_KINDS = {torch.bfloat16: "BF16", torch.float16: "F16"}


@dataclass(frozen=True)
class StoredWeight:
    """A [rows, cols] weight in its stored format: `data` is bf16/fp16 [rows, cols] or uint8 [rows, row_bytes]."""

    data: torch.Tensor
    kind: str
    rows: int
    cols: int

    @classmethod
    def of(
        cls, data: torch.Tensor, kind: str | None = None, cols: int | None = None
    ) -> StoredWeight:
        """Wrap a bf16/fp16 matrix, or a GGUF block matrix of `kind` holding `cols` weights per row."""
        if kind is None:
            if data.dtype not in TORCH_KINDS:
                raise ValueError(f"a stored weight is bf16, fp16 or GGUF blocks (got {data.dtype})")
            return cls(data, TORCH_KINDS[data.dtype], data.shape[0], data.shape[1])
        if (
            kind not in KINDS
            or kind in TORCH_KINDS.values()
            or data.dtype != torch.uint8
            or cols is None
        ):
            raise ValueError(
                f"GGUF blocks need a kind in {sorted(BLOCKS)}, uint8 data and cols (got {kind}, {data.dtype})"
            )
        per, size = BLOCKS.get(kind, (1, 1))
        nbytes = cols + 2 if kind == "I8R" else cols // per * size
        if cols % per or data.dim() != 2 or data.shape[1] != nbytes:
            raise ValueError(
                f"{kind} rows of {cols} weights are {nbytes} bytes, not {tuple(data.shape)}"
            )
        return cls(data, kind, data.shape[0], cols)

    @classmethod
    def tagged(cls, data: torch.Tensor, tag: str) -> StoredWeight:
        """GGUF blocks with their store tag ("KIND/COLS", store/quant.py), or a row-int8 matrix ("I8R/COLS")."""
        if tag.startswith("I8R/"):
            return cls.of(data, "I8R", int(tag[4:]))
        kind, cols = parse_quant(tag)
        return cls.of(data, kind, cols)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def dequantize(w: StoredWeight) -> torch.Tensor:
    """fp32 [rows, cols]: the exact decode (the widened path's weights)."""
    if w.kind in ("BF16", "F16"):
        return w.data.float()
    if kernel_ok(w):
        out = torch.empty(w.rows, w.cols, dtype=torch.float32)
        rc = CPU.load().df_stored_dequant(
            KINDS[w.kind],
            w.data.data_ptr(),
            w.rows,
            w.cols,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if rc == 0:
            return out
    if w.kind == "I8R":
        return (
            w.data[:, :2].contiguous().view(torch.float16).float()
            * w.data[:, 2:].view(torch.int8).float()
        )
    return gguf_dequantize(w)


def to_row_int8(w: torch.Tensor) -> torch.Tensor:
    """The row-int8 (docs/kimi-k3-drafting-io.md §9.6) of a float matrix [R, C]: uint8 [R, 2 + C], each row its f16 scale
    (max|w| / 127, 1 for an all-zero row) then clamp(round_half_even(w / scale), -127, 127) as int8."""
    w = w.float()
    scale = w.abs().amax(dim=1, keepdim=True) / 127.0
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.clamp(torch.round(w / scale), -127, 127).to(
        torch.int8
    )  # torch.round rounds half to even
    return torch.cat(
        [scale.to(torch.float16).view(torch.uint8), q.view(torch.uint8)], dim=1
    ).contiguous()


def gguf_dequantize(w: StoredWeight) -> torch.Tensor:
    """gguf-py's numpy decode: the oracle the kernel must match bit for bit."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as np_dequantize

    raw = w.data.cpu().contiguous().numpy()
    out = np_dequantize(raw, GGMLQuantizationType(KINDS[w.kind]))
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32).reshape(w.rows, w.cols)).to(
        w.data.device
    )


# kinds whose codes index a grid: gguf-py's, handed to the kernel (`set_grids`); IQ1_M reads IQ1_S's
GRIDS = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M")


def set_grids(lib: ctypes.CDLL) -> None:
    """Hand gguf-py's IQ code grids to a kernel library, once: one copy of the tables, gguf-py's."""
    if getattr(lib, "grids_set", False):
        return
    from gguf import quants

    lib.df_stored_set_grid.argtypes = [ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64]
    for kind in GRIDS[:-1]:
        table = getattr(quants, kind)
        table.init_grid()
        values = np.ascontiguousarray(table.grid.reshape(-1), dtype=np.int8)
        if lib.df_stored_set_grid(KINDS[kind], values.ctypes.data, values.size) != 0:
            raise RuntimeError(
                f"the CPU kernels refused gguf-py's {kind} grid of {values.size} values"
            )
    lib.grids_set = True


@functools.cache
def _kernel_takes(kind: str, cols: int) -> bool:
    """Whether the CPU kernel is built and takes rows of `cols` weights in `kind` (asked once per shape)."""
    lib = CPU.load()
    if lib is not None and kind in GRIDS:
        set_grids(lib)
    return lib is not None and lib.df_stored_row_bytes(KINDS[kind], cols) > 0


def kernel_ok(w: StoredWeight) -> bool:
    """Whether the CPU kernel computes on `w` as it lies: on the CPU, contiguous, a shape it takes."""
    return w.data.device.type == "cpu" and w.data.is_contiguous() and _kernel_takes(w.kind, w.cols)
