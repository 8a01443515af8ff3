"""Block Attention Residuals (docs/kimi-k3-format.md §4.2): a learned softmax over earlier representations.

K3 has no residual stream: each sub-layer reads a mixture of the completed block
sums ("anchors") and the current block's partial sum, scored by a pseudo-query
against RMS-normalised values. Mixing is across depth, per token, so nothing is
cached across time. Owns the mixing function and the anchor schedule.
"""

from __future__ import annotations

import math

import torch


def attn_res(
    values: list[torch.Tensor],
    norm_weight: torch.Tensor,
    proj_weight: torch.Tensor,
    eps: float = 1e-5,
) -> torch.Tensor:
    """Mix `values` (m tensors [T, H]) with weights softmax_m(<rmsnorm(v, n), p>).

    norm_weight [H] and proj_weight [1, H] are one sub-layer's `*_res_norm` and
    `*_res_proj`; they are folded into one vector n*p as deltafin does. Keys are
    normalised, the mixture combines the unnormalised values. fp32 softmax.
    """
    vmat = torch.stack(values, dim=0).float()  # [m, T, H]
    keys = vmat * torch.rsqrt(vmat.pow(2).mean(-1, keepdim=True) + eps)  # RMSNorm without weight
    query = norm_weight.float() * proj_weight.float()[0]  # [H]
    scores = keys @ query  # [m, T]
    weights = torch.softmax(scores, dim=0)  # over the m values
    return torch.einsum("mt,mth->th", weights, vmat).to(values[0].dtype)


def is_block_start(layer_idx: int, block_size: int) -> bool:
    return layer_idx % block_size == 0


def anchors_before(layer_idx: int, block_size: int) -> int:
    """Anchors held when layer `layer_idx` starts: ceil(l / block)."""
    return math.ceil(layer_idx / block_size)


def anchors_after(layer_idx: int, block_size: int) -> int:
    """Anchors held after layer `layer_idx`'s boundary step: floor(l / block) + 1."""
    return layer_idx // block_size + 1


class AttnResStream:
    """The per-pass state of the recurrence: anchors A, the carried value h, the block sum P."""

    def __init__(self, embedding: torch.Tensor, block_size: int) -> None:
        self.block_size = block_size
        self.anchors: list[torch.Tensor] = []
        self.h = embedding  # [T, H]
        self.partial: torch.Tensor | None = None

    def attention_input(
        self, layer_idx: int, norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """x for layer l's attention; also performs the block-boundary step."""
        x = self.h if not self.anchors else attn_res([*self.anchors, self.h], norm_w, proj_w, eps)
        if is_block_start(layer_idx, self.block_size):
            self.anchors = [
                *self.anchors,
                self.h,
            ]  # h closes the previous block (the embedding at l = 0)
            self.partial = None
        else:
            self.partial = self.h
        return x

    def add_attention(self, a_out: torch.Tensor) -> None:
        self.partial = a_out if self.partial is None else self.partial + a_out

    def mlp_input(self, norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float) -> torch.Tensor:
        assert self.partial is not None
        return attn_res([*self.anchors, self.partial], norm_w, proj_w, eps)

    def add_mlp(self, m_out: torch.Tensor) -> None:
        assert self.partial is not None
        self.h = self.partial + m_out

    def output(self, norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float) -> torch.Tensor:
        """The tail: mix every anchor and the last partial sum."""
        return attn_res([*self.anchors, self.h], norm_w, proj_w, eps)
