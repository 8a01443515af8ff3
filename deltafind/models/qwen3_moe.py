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

from deltafind.models.ops.cpu_kernels import CPU
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
    """HF `mlp.gate`: a bias-free linear to expert logits, softmax, top-k, optional renormalisation.

    One token on the CPU with an fp32 weight is ONE kernel call (layer_cpu.cpp's df_route_token: the
    logits, softmax, top-k and renormalisation, differing from these torch ops only in summation order
    and exp's last bit, an equal probability taking the lower expert id first; docs/math-modes.md);
    anything else (a prompt, a batch, bf16 weights, no compiler) takes the torch ops."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(args.num_experts, args.hidden_size))
        self.top_k, self.norm_topk_prob = args.num_experts_per_tok, args.norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if x.shape[0] == 1 and (route := self.one_token(x)) is not None:
            return route
        # The same ops as F.softmax(F.linear(x, W).float()) less the no-op casts: each op outside the
        # kernels costs a decode token ~3 us a layer (tests/bench/RESULTS.md).
        logits = F.linear(x, self.weight)
        probs = (logits if logits.dtype == torch.float32 else logits.float()).softmax(-1)  # [T, E]
        weight, idx = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            weight = weight / weight.sum(dim=-1, keepdim=True)
        return idx, weight if weight.dtype == x.dtype else weight.to(x.dtype)

    def one_token(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(ids [1, k], weights [1, k]) for one token x [1, H] in one df_route_token call: two torch ops
        (the outputs' allocations) where the torch path made five of 5-100 us each on one token
        (tests/bench/RESULTS.md); None where the kernel does not take x or the weight."""
        w, k = self.weight, self.top_k
        if (
            (lib := CPU.load()) is None
            or x.dtype != torch.float32
            or w.dtype != torch.float32
            or x.dim() != 2
            or not (x.is_cpu and w.is_cpu and x.is_contiguous() and w.is_contiguous())
            or x.shape[1] != w.shape[1]
            or not 0 < k <= w.shape[0]
        ):
            return None
        idx, weight = torch.empty(1, k, dtype=torch.int64), torch.empty(1, k, dtype=torch.float32)
        if lib.df_route_token(
            w.data_ptr(),
            w.shape[0],
            w.shape[1],
            x.data_ptr(),
            k,
            self.norm_topk_prob,
            idx.data_ptr(),
            weight.data_ptr(),
            torch.get_num_threads(),
        ):
            return None  # a NaN or inf among the logits: torch's ops say what they make of it
        return idx, weight


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
