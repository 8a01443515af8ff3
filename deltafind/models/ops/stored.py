"""Matmul on weights in the format they are stored in: bf16, fp16 and GGUF block formats.

A `StoredWeight` is a logical [rows, cols] matrix kept as its stored bytes: a bf16/fp16
tensor, or uint8 [rows, row_bytes] of llama.cpp blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
Q4_K, Q5_K, Q6_K). `stored_linear(x, w)` computes `x @ W.T` with fp32 activations and
fp32 accumulation, every weight decoded exactly as the fp32-widened path decodes it
(bf16/fp16: the exact widening; GGUF: gguf-py's `dequantize`, the import's oracle):
on the CPU through stored_cpu.cpp, elsewhere (or without a compiler) by decoding into
a scratch matrix and one BLAS matmul. Results equal the widened path within fp32
summation-order noise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from deltafind.models.ops.cpu_kernels import STORED

# GGML type ids (gguf.GGMLQuantizationType): the kind codes stored_cpu.cpp takes.
KINDS = {"F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "BF16": 30}
BLOCKS = {"F16": (1, 2), "BF16": (1, 2), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
          "Q8_0": (32, 34), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}  # (weights, bytes) per block
TORCH_KINDS = {torch.bfloat16: "BF16", torch.float16: "F16"}


@dataclass(frozen=True)
class StoredWeight:
    """A [rows, cols] weight in its stored format: `data` is bf16/fp16 [rows, cols] or uint8 [rows, row_bytes]."""

    data: torch.Tensor
    kind: str
    rows: int
    cols: int

    @classmethod
    def of(cls, data: torch.Tensor, kind: str | None = None, cols: int | None = None) -> StoredWeight:
        """Wrap a bf16/fp16 matrix, or a GGUF block matrix of `kind` holding `cols` weights per row."""
        if kind is None:
            if data.dtype not in TORCH_KINDS:
                raise ValueError(f"a stored weight is bf16, fp16 or GGUF blocks (got {data.dtype})")
            return cls(data, TORCH_KINDS[data.dtype], data.shape[0], data.shape[1])
        if kind not in BLOCKS or data.dtype != torch.uint8 or cols is None:
            raise ValueError(f"GGUF blocks need a kind in {sorted(BLOCKS)}, uint8 data and cols (got {kind}, {data.dtype})")
        per, size = BLOCKS[kind]
        if cols % per or data.dim() != 2 or data.shape[1] != cols // per * size:
            raise ValueError(f"{kind} rows of {cols} weights are {cols // per * size} bytes, not {tuple(data.shape)}")
        return cls(data, kind, data.shape[0], cols)

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def dequantize(w: StoredWeight) -> torch.Tensor:
    """fp32 [rows, cols]: the exact decode (the widened path's weights)."""
    if w.kind in ("BF16", "F16"):
        return w.data.float()
    if _kernel_ok(w):
        out = torch.empty(w.rows, w.cols, dtype=torch.float32)
        rc = STORED.load().df_stored_dequant(KINDS[w.kind], w.data.data_ptr(), w.rows, w.cols, out.data_ptr(),
                                              torch.get_num_threads())
        if rc == 0:
            return out
    return gguf_dequantize(w)


def gguf_dequantize(w: StoredWeight) -> torch.Tensor:
    """gguf-py's numpy decode: the oracle the kernel must match bit for bit."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as np_dequantize

    raw = w.data.cpu().contiguous().numpy()
    out = np_dequantize(raw, GGMLQuantizationType(KINDS[w.kind]))
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32).reshape(w.rows, w.cols)).to(w.data.device)


def _kernel_ok(w: StoredWeight) -> bool:
    return (w.data.device.type == "cpu" and w.data.is_contiguous() and STORED.load() is not None
            and STORED.load().df_stored_row_bytes(KINDS[w.kind], w.cols) > 0)


def stored_linear(x: torch.Tensor, w: StoredWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ W.T (+ bias)` for fp32 `x` [..., cols]: fp32 out [..., rows], weights read in their stored format."""
    if x.dtype != torch.float32 or not (x.device.type == "cpu" and _kernel_ok(w)):
        return F.linear(x, dequantize(w).to(x.dtype), bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.cols).contiguous()
    y = torch.empty(x2.shape[0], w.rows, dtype=torch.float32)
    rc = STORED.load().df_stored_matmul(KINDS[w.kind], x2.data_ptr(), x2.shape[0], w.cols, w.data.data_ptr(),
                                        w.rows, w.cols, y.data_ptr(), w.rows, torch.get_num_threads())
    if rc != 0:
        return F.linear(x, dequantize(w), bias)
    if bias is not None:
        y += bias
    return y.reshape(*lead, w.rows)
