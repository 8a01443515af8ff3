"""Latent MoE (docs/kimi-k3-format.md §4.8): a sigmoid noaux_tc router on the full width, MXFP4 routed
experts working in a narrower latent, and fused shared experts on the full width.

r_in = down(x) is shared by the chosen experts; each runs SiTU(w1 r, w3 r) -> w2;
the weighted sum is RMS-normalised and projected back up, then shared experts are
added. Routed experts come from an `ExpertProvider` as MXFP4 packs, untouched.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from deltafind.models.contract import RoutedExperts
from deltafind.models.ops.moe import dispatch
from deltafind.models.ops.mxfp4 import can_fuse, fused_gate_up_situ, mxfp4_linear
from deltafind.models.ops.norm import RMSNorm
from deltafind.models.ops.situ import SiTUMLP, situ
from deltafind.provider import Expert, ExpertProvider


class SigmoidRouter(nn.Module):
    """`gate`: sigmoid scores; the bias picks experts, unbiased scores weight them."""

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        num_groups: int = 1,
        topk_group: int = 1,
        renormalize: bool = True,
        scaling: float = 1.0,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.e_score_correction_bias = nn.Parameter(torch.empty(num_experts))
        self.num_experts, self.top_k = num_experts, top_k
        self.num_groups, self.topk_group = num_groups, topk_group
        self.renormalize, self.scaling = renormalize, scaling

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ids [T, k] and fp32 weights [T, k] for x [T, H]."""
        t = x.shape[0]
        scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))  # [T, E]
        choice = scores + self.e_score_correction_bias.float()
        if self.topk_group < self.num_groups:  # DeepSeek's group step; K3 has one group
            grouped = choice.view(t, self.num_groups, -1)
            best = (
                grouped.topk(2, dim=-1)[0].sum(-1).topk(self.topk_group, dim=-1)[1]
            )  # [T, topk_group]
            keep = torch.zeros(t, self.num_groups, dtype=torch.bool, device=x.device).scatter_(
                1, best, True
            )
            choice = choice.masked_fill(
                ~keep[:, :, None].expand_as(grouped).reshape(t, -1), float("-inf")
            )
        idx = choice.topk(self.top_k, dim=-1, sorted=False)[1]
        weight = scores.gather(1, idx)
        if self.renormalize:
            weight = weight / (weight.sum(-1, keepdim=True) + 1e-20)
        return idx, weight * self.scaling


def _pack(expert: Expert, part: str) -> tuple[torch.Tensor, torch.Tensor]:
    packed, scale = expert[f"{part}.weight_packed"], expert[f"{part}.weight_scale"]
    # A provider that widened the bytes to floats (0..255, exactly) gets them narrowed back.
    return (
        packed if packed.dtype == torch.uint8 else packed.to(torch.uint8),
        scale if scale.dtype == torch.uint8 else scale.to(torch.uint8),
    )


def mxfp4_expert_forward(
    r: torch.Tensor, expert: Expert, beta: float = 4.0, linear_beta: float = 25.0
) -> torch.Tensor:
    """One routed expert in the latent: r [n, L] fp32 -> w2 @ situ(w1 r, w3 r), [n, L]."""
    w1, w3 = _pack(expert, "w1"), _pack(expert, "w3")
    if can_fuse(r, w1[0]):
        h = fused_gate_up_situ(
            r, w1, w3, beta, linear_beta
        )  # one call: no torch op between the halves
    else:
        h = situ(mxfp4_linear(r, *w1), mxfp4_linear(r, *w3), beta, linear_beta)  # [n, I]
    return mxfp4_linear(h, *_pack(expert, "w2"))


class LatentMoE(RoutedExperts):
    """`block_sparse_moe`: router, latent down/norm/up, provider experts, shared experts."""

    def __init__(
        self,
        hidden: int,
        latent: int,
        shared_width: int,
        router: SigmoidRouter,
        layer_idx: int,
        provider: ExpertProvider,
        eps: float,
        beta: float,
        linear_beta: float,
    ) -> None:
        super().__init__()
        self.gate = router
        self.routed_expert_down_proj = nn.Linear(hidden, latent, bias=False)
        self.routed_expert_norm = RMSNorm(latent, eps)
        self.routed_expert_up_proj = nn.Linear(latent, hidden, bias=False)
        self.shared_experts = SiTUMLP(hidden, shared_width, beta, linear_beta)
        self.layer_idx, self.provider = layer_idx, provider
        self.beta, self.linear_beta = beta, linear_beta
        self.run = partial(
            mxfp4_expert_forward, beta=beta, linear_beta=linear_beta
        )  # an expert node runs it too

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx, weight = self.gate(x)
        r_in = self.routed_expert_down_proj(x).float()  # [T, L], shared by all chosen experts
        r_sum = dispatch(r_in, idx, weight, self.provider, self.layer_idx, self.run)
        r_out = self.routed_expert_up_proj(self.routed_expert_norm(r_sum).to(x.dtype))
        return r_out + self.shared_experts(x)
