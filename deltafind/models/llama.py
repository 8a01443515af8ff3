"""Llama family (Llama 2/3, SmolLM2 and friends): GQA + rope + SwiGLU, tied embeddings optional.

The dense MLP of every layer runs as expert slices from the provider.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deltafind.errors import UnsupportedModelError
from deltafind.models.ops.moe import SlicedMLP, swiglu
from deltafind.models.transformer import (
    Attention,
    CausalLM,
    DecoderLayer,
    FromConfig,
    common_post_init,
    make_rope,
)
from deltafind.store.provider import HF_WEIGHTS, ExpertProvider, WeightNames


@dataclass
class ModelArgs(FromConfig):
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    rope: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        common_post_init(self)
        if self.mlp_bias:
            raise UnsupportedModelError("llama configs with mlp_bias=true are not supported yet")


class Model(CausalLM):
    def __init__(self, args: ModelArgs, experts: ExpertProvider) -> None:
        def make_layer(i: int) -> DecoderLayer:
            return DecoderLayer(args, Attention(args, i, qk_norm=self.qk_norm), SlicedMLP(i, experts, swiglu(args.hidden_act)))

        super().__init__(args, make_layer, make_rope(args), experts)

    qk_norm = False


def weight_names(args: ModelArgs) -> WeightNames:
    """transformers' names: every layer's `mlp.{gate,up,down}_proj` is a dense MLP stored as slices."""
    return HF_WEIGHTS
