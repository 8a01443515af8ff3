"""Multi-head latent attention (DeepSeek V2/V3, Kimi K2) under HF parameter names.

Owns the low-rank q and kv projections, rope on the rope part of each head only,
and the softmax scale with YaRN's `mscale_all_dim` correction. It knows nothing
of routing or experts; the caller hands it the cos/sin of `qk_rope_head_dim`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from deltafind.models.ops.attention import attend
from deltafind.models.ops.batch import Batch
from deltafind.models.ops.norm import RMSNorm
from deltafind.models.ops.rope import apply_rope, apply_rope_interleaved, yarn_get_mscale


def mla_softmax_scale(
    qk_head_dim: int, rope: dict[str, Any], max_position_embeddings: int
) -> float:
    """qk_head_dim**-0.5, times mscale**2 when a scaled rope sets `mscale_all_dim` (as HF does)."""
    scale = qk_head_dim**-0.5
    mscale_all_dim = rope.get("mscale_all_dim")
    if rope.get("rope_type", "default") != "default" and mscale_all_dim:
        factor = rope.get("factor")
        if factor is None:  # YaRN's fallback, as in ops/rope.py
            original = rope.get("original_max_position_embeddings") or max_position_embeddings
            factor = max_position_embeddings / original
        mscale = yarn_get_mscale(float(factor), float(mscale_all_dim))
        scale *= mscale * mscale
    return scale


class MLAttention(nn.Module):
    """MLA: q = q_b(norm(q_a x)) (or q_proj x), kv from a shared latent plus one rope key.

    args needs hidden_size, num_attention_heads, q_lora_rank (None: plain q_proj),
    kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, attention_bias,
    rope_interleave, rope and max_position_embeddings.
    """

    def __init__(self, args: Any, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = args.num_attention_heads
        self.q_lora_rank, self.kv_lora_rank = args.q_lora_rank, args.kv_lora_rank
        self.nope_dim, self.rope_dim = args.qk_nope_head_dim, args.qk_rope_head_dim
        self.v_dim = args.v_head_dim
        self.qk_dim = self.nope_dim + self.rope_dim
        h, bias = args.hidden_size, args.attention_bias
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(h, self.num_heads * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, self.q_lora_rank, bias=bias)
            # HF builds both latent norms with the default eps, not rms_norm_eps.
            self.q_a_layernorm = RMSNorm(self.q_lora_rank)
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.num_heads * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank)
        kv_b_width = self.num_heads * (self.nope_dim + self.v_dim)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, kv_b_width, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, h, bias=bias)
        self.rotate = apply_rope_interleaved if args.rope_interleave else apply_rope
        self.scale = mla_softmax_scale(self.qk_dim, args.rope, args.max_position_embeddings)

    def forward(
        self, x: torch.Tensor, batch: Batch, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        t, heads = x.shape[0], self.num_heads
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, heads, self.qk_dim)
        q_nope, q_rot = q.split(
            [self.nope_dim, self.rope_dim], dim=-1
        )  # [T, H, nope], [T, H, rope]
        kv_a = self.kv_a_proj_with_mqa(x)  # [T, kv_lora_rank + rope]
        latent, k_rot = kv_a.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)  # [T, kv_lora_rank]
        q_rot = self.rotate(q_rot, cos, sin)  # [T, H, rope]
        k_rot = self.rotate(
            k_rot.reshape(t, 1, self.rope_dim), cos, sin
        )  # [T, 1, rope], one for all heads
        kv = self.kv_b_proj(latent).view(t, heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)  # [T, H, nope], [T, H, v]
        q = torch.cat((q_nope, q_rot), dim=-1)  # [T, H, qk]
        k = torch.cat((k_nope, k_rot.expand(t, heads, self.rope_dim)), dim=-1)  # [T, H, qk]
        # PERF: this caches per-head k/v, H*(qk+v) values a token; caching the
        # normalised latent and rope key (kv_lora_rank + rope) and absorbing
        # kv_b_proj into q and o (DeepSeek's "absorb" decode) is far smaller.
        o = attend(q, k, v, batch, self.layer_idx, scale=self.scale)  # [T, H, v]
        return self.o_proj(o.reshape(t, heads * self.v_dim))
