"""RMSNorm as the HF families define it (normalise in fp32, scale in the input dtype)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deltafind.models.ops.cpu_kernels import CPU


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            if (y := rms_norm_cpu(x, self.weight, self.eps)) is not None:
                return y
            # PERF: one fused op (5 before) for the same fp32 arithmetic; other dtypes keep HF's casts.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """fp32 RMSNorm over the last dim of x [..., C] on the CPU in one kernel call (layer_cpu.cpp; F.rms_norm
    cost 10-30 us a row), or None where it does not apply (another device or layout, no compiler)."""
    if (
        x.dtype != torch.float32
        or weight.dtype != torch.float32
        or not x.is_cpu  # not x.device.type: a device object per call
        or not weight.is_cpu
        or (cols := x.shape[-1]) % 8
        or x.dim() < 2
        or weight.dim() != 1
        or weight.shape[0] != cols
        or not weight.is_contiguous()
        or (lib := CPU.load()) is None
    ):
        return None
    flat = x.dim() == 2 and x.stride(1) == 1
    rows = x if flat else x.reshape(-1, cols)  # q/k heads: [T, H, D] -> [T*H, D]
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    y = torch.empty(rows.shape)
    lib.df_rms_norm(
        rows.data_ptr(),
        rows.shape[0],
        cols,
        rows.stride(0),
        weight.data_ptr(),
        eps,
        y.data_ptr(),
    )
    if flat:
        return y
    return y.view(x.shape)
