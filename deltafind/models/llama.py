"""Llama family (Llama 2/3, SmolLM2 and friends): GQA + rope + SwiGLU, tied embeddings optional.

The dense MLP of every layer runs as expert slices from the provider.
"""

from __future__ import annotations

from dataclasses import dataclass

from deltafind.errors import UnsupportedModelError
from deltafind.models.ops.gated_mlp import swiglu
from deltafind.models.ops.moe import SlicedMLP
from deltafind.models.transformer import (
    Attention,
    CausalLM,
    DecoderArgs,
    DecoderLayer,
    make_rope,
)
from deltafind.provider import HF_WEIGHTS, ExpertProvider, WeightNames


@dataclass(kw_only=True)
class ModelArgs(DecoderArgs):
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mlp_bias:
            raise UnsupportedModelError("llama configs with mlp_bias=true are not supported yet")


class Model(CausalLM):
    def __init__(self, args: ModelArgs, experts: ExpertProvider) -> None:
        def make_layer(i: int) -> DecoderLayer:
            return DecoderLayer(
                args,
                Attention(args, i, qk_norm=self.qk_norm),
                SlicedMLP(i, experts, swiglu(args.hidden_act)),
            )

        super().__init__(args, make_layer, make_rope(args), experts)

    qk_norm = False


def weight_names(args: ModelArgs) -> WeightNames:
    """transformers' names: every layer's `mlp.{gate,up,down}_proj` is a dense MLP stored as slices."""
    return HF_WEIGHTS
