"""OLMoE (AllenAI): Qwen3-MoE's softmax top-k routing behind Llama attention whose q and k are
RMS-normalised over the whole projection (not per head) and optionally clipped (`clip_qkv`).

Every layer is routed; the experts' width is config.json's `intermediate_size`. Weight names are
transformers' (`mlp.gate`, `mlp.experts.{e}.*_proj`), as in qwen3_moe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from deltafind.models import qwen3_moe
from deltafind.models.ops.attention import attend
from deltafind.models.ops.batch import Batch
from deltafind.models.ops.norm import RMSNorm
from deltafind.models.ops.rope import apply_rope
from deltafind.models.transformer import CausalLM, DecoderLayer, RoutedMoE, make_rope
from deltafind.provider import ExpertProvider


@dataclass(kw_only=True)
class ModelArgs(qwen3_moe.ModelArgs):
    clip_qkv: float | None = None
    ALIASES: ClassVar[dict[str, str]] = {"intermediate_size": "moe_intermediate_size"}


class Attention(nn.Module):
    """GQA with rope; q_norm / k_norm span all heads of q_proj / k_proj, as in HF's OlmoeAttention."""

    def __init__(self, args: Any, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx, self.clip = layer_idx, args.clip_qkv
        self.num_heads, self.num_kv_heads, self.head_dim = (
            args.num_attention_heads,
            args.num_key_value_heads,
            args.head_dim,
        )
        h, hq, hkv, bias = (
            args.hidden_size,
            self.num_heads * args.head_dim,
            self.num_kv_heads * args.head_dim,
            args.attention_bias,
        )
        self.q_proj, self.k_proj = nn.Linear(h, hq, bias=bias), nn.Linear(h, hkv, bias=bias)
        self.v_proj, self.o_proj = nn.Linear(h, hkv, bias=bias), nn.Linear(hq, h, bias=bias)
        self.q_norm, self.k_norm = RMSNorm(hq, args.rms_norm_eps), RMSNorm(hkv, args.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, batch: Batch, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        t, d = x.shape[0], self.head_dim
        q, k, v = (
            self.q_norm(self.q_proj(x)),
            self.k_norm(self.k_proj(x)),
            self.v_proj(x),
        )  # [T, H*D]
        if self.clip is not None:
            q, k, v = (y.clamp(-self.clip, self.clip) for y in (q, k, v))
        q = apply_rope(q.view(t, self.num_heads, d), cos, sin)  # [T, Hq, D]
        k = apply_rope(k.view(t, self.num_kv_heads, d), cos, sin)  # [T, Hkv, D]
        o = attend(q, k, v.view(t, self.num_kv_heads, d), batch, self.layer_idx, scale=d**-0.5)
        return self.o_proj(o.reshape(t, self.num_heads * d))


class Model(CausalLM):
    def __init__(self, args: ModelArgs, experts: ExpertProvider) -> None:
        def make_layer(i: int) -> DecoderLayer:
            return DecoderLayer(
                args,
                Attention(args, i),
                RoutedMoE(qwen3_moe.Router(args), i, experts, args.hidden_act),
            )

        super().__init__(args, make_layer, make_rope(args), experts)


weight_names = qwen3_moe.weight_names
