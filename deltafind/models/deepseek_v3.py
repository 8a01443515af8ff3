"""DeepSeek-V3 and Kimi K2: MLA attention, sigmoid `noaux_tc` routing, shared experts.

Routing follows HF: sigmoid scores in fp32; `e_score_correction_bias` is added
only to choose experts (group top-k, then top-k), the weights are the unbiased
scores, optionally renormalised, times `routed_scaling_factor`. The first
`first_k_dense_replace` layers (and those off the `moe_layer_freq` grid) are
dense MLPs run as expert slices; shared experts stay resident.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import ClassVar, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from deltafind.errors import UnsupportedModelError
from deltafind.models.ops.gated_mlp import activation, swiglu
from deltafind.models.ops.mla import MLAttention
from deltafind.models.ops.moe import DenseMLP, SlicedMLP
from deltafind.models.transformer import CausalLM, DecoderArgs, DecoderLayer, RoutedMoE, make_rope
from deltafind.provider import HF_WEIGHTS, ExpertProvider, WeightNames

T = TypeVar("T")


@dataclass(kw_only=True)
class ModelArgs(DecoderArgs):
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    # Defaults below are transformers' DeepseekV3Config defaults, so a config.json
    # that omits a key means what it means to HF.
    n_shared_experts: int | None = 1
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    n_group: int | None = 8
    topk_group: int | None = 4
    first_k_dense_replace: int | None = 3
    moe_layer_freq: int = 1  # DeepSeek's own code reads it; HF's does not (all configs ship 1)
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    num_nextn_predict_layers: int = 0  # MTP layers stored after the last decoder layer; not run
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    # transformers 5 spellings (its attribute_map) -> the names DeepSeek's config.json uses.
    ALIASES: ClassVar[dict[str, str]] = {
        "num_local_experts": "n_routed_experts",
        "num_mtp_layers": "num_nextn_predict_layers",
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.scoring_func != "sigmoid" or self.topk_method != "noaux_tc":
            raise UnsupportedModelError(
                f"deepseek_v3 routing scoring_func={self.scoring_func!r} topk_method={self.topk_method!r} "
                "is not supported (supported: sigmoid with noaux_tc)"
            )
        self.n_group = self.n_group or 1
        self.topk_group = self.topk_group or self.n_group
        self.first_k_dense_replace = self.first_k_dense_replace or 0
        if self.n_routed_experts % self.n_group:
            raise UnsupportedModelError(
                f"n_routed_experts={self.n_routed_experts} is not a multiple of n_group={self.n_group}; "
                "fix config.json"
            )

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (
            self.n_routed_experts > 0
            and layer_idx >= self.first_k_dense_replace
            and layer_idx % self.moe_layer_freq == 0
        )


class NoAuxRouter(nn.Module):
    """HF `mlp.gate`: sigmoid scores, bias-corrected grouped top-k choice. fp32 throughout."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.num_experts, self.top_k = args.n_routed_experts, args.num_experts_per_tok
        self.num_groups, self.topk_group = args.n_group, args.topk_group
        self.norm_topk_prob = args.norm_topk_prob
        self.routed_scaling_factor = args.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(self.num_experts, args.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.empty(self.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ids [T, k] and fp32 weights [T, k] for x [T, H]."""
        t = x.shape[0]
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias.float()
        group_size = self.num_experts // self.num_groups
        if self.topk_group < self.num_groups:
            # A group's score is the sum of its best two experts (DeepSeek's noaux_tc).
            grouped = choice.view(t, self.num_groups, group_size)
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
            group_idx = group_scores.topk(self.topk_group, dim=-1, sorted=False)[
                1
            ]  # [T, topk_group]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
            keep = keep[:, :, None].expand_as(grouped).reshape(t, self.num_experts)  # [T, E]
            choice = choice.masked_fill(~keep, float("-inf"))
        idx = choice.topk(self.top_k, dim=-1, sorted=False)[1]  # [T, k]
        weight = scores.gather(1, idx)
        if self.norm_topk_prob:
            weight = weight / (weight.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, weight * self.routed_scaling_factor


class MoE(RoutedMoE):
    """Routed experts from the provider plus resident shared experts."""

    def __init__(self, args: ModelArgs, layer_idx: int, experts: ExpertProvider) -> None:
        super().__init__(NoAuxRouter(args), layer_idx, experts, args.hidden_act)
        self.shared_experts = None
        if args.n_shared_experts:
            width = args.moe_intermediate_size * args.n_shared_experts
            self.shared_experts = DenseMLP(args.hidden_size, width, activation(args.hidden_act))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class Model(CausalLM):
    def __init__(self, args: ModelArgs, experts: ExpertProvider) -> None:
        def make_layer(i: int) -> DecoderLayer:
            mlp = (
                MoE(args, i, experts)
                if args.is_moe_layer(i)
                else SlicedMLP(i, experts, swiglu(args.hidden_act))
            )
            return DecoderLayer(args, MLAttention(args, i), mlp)

        super().__init__(args, make_layer, make_rope(args, dim=args.qk_rope_head_dim), experts)


def sanitize(args: ModelArgs, weights: dict[str, T]) -> dict[str, T]:
    """Drop the MTP layers stored after the last decoder layer (`model.layers.61.*` in V3): not run, not imported."""

    def layer_of(name: str) -> int:
        parts = name.split(".")
        return int(parts[2]) if name.startswith("model.layers.") and parts[2].isdigit() else -1

    return {k: v for k, v in weights.items() if layer_of(k) < args.num_hidden_layers}


def weight_names(args: ModelArgs) -> WeightNames:
    """transformers' names, less the multi-token-prediction layers (`num_nextn_predict_layers`)."""
    return dataclasses.replace(HF_WEIGHTS, sanitize=partial(sanitize, args))
