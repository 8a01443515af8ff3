"""Qwen3-MoE: Qwen3 attention, softmax top-k routing over routed experts.

Routing follows HF: softmax in fp32 over all experts, top-k, optional
renormalisation (`norm_topk_prob`). Layers listed in `mlp_only_layers` or off
the `decoder_sparse_step` grid are dense MLPs, run as expert slices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from deltafind.models.ops.gated_mlp import swiglu
from deltafind.models.ops.moe import SlicedMLP
from deltafind.models.transformer import (
    Attention,
    CausalLM,
    DecoderArgs,
    DecoderLayer,
    RoutedMoE,
    make_rope,
)
from deltafind.provider import HF_WEIGHTS, ExpertProvider, WeightNames


@dataclass(kw_only=True)
class ModelArgs(DecoderArgs):
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    ALIASES: ClassVar[dict[str, str]] = {
        "num_local_experts": "num_experts"
    }  # transformers 5's name

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (
            layer_idx not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )


class Router(nn.Module):
    """HF `mlp.gate`: a bias-free linear to expert logits."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(args.num_experts, args.hidden_size))
        self.top_k, self.norm_topk_prob = args.num_experts_per_tok, args.norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # The same ops as F.softmax(F.linear(x, W).float()) less the no-op casts: each op outside the
        # kernels costs a decode token ~3 us a layer (tests/bench/RESULTS.md).
        logits = F.linear(x, self.weight)
        probs = (logits if logits.dtype == torch.float32 else logits.float()).softmax(-1)  # [T, E]
        weight, idx = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            weight = weight / weight.sum(dim=-1, keepdim=True)
        return idx, weight if weight.dtype == x.dtype else weight.to(x.dtype)


class Model(CausalLM):
    def __init__(self, args: ModelArgs, experts: ExpertProvider) -> None:
        def make_layer(i: int) -> DecoderLayer:
            mlp = (
                RoutedMoE(Router(args), i, experts, args.hidden_act)
                if args.is_moe_layer(i)
                else SlicedMLP(i, experts, swiglu(args.hidden_act))
            )
            return DecoderLayer(args, Attention(args, i, qk_norm=True), mlp)

        super().__init__(args, make_layer, make_rope(args), experts)


def weight_names(args: ModelArgs) -> WeightNames:
    """transformers' names: `mlp.experts.{e}.*_proj` routed, `mlp.*_proj` dense (mlp_only_layers)."""
    return HF_WEIGHTS
