"""Multi-head latent attention without rotary ("NoPE") and with a sigmoid output gate (docs/kimi-k3-format.md §4.5).

K3's MLA: q from a low-rank latent, k/v from a normalised KV latent plus one
unnormalised, unrotated 64-wide key part shared by all heads, scale
(nope + rope)^-0.5, causal softmax in fp32, then out * sigmoid(g_proj x) before
o_proj. The cache is deltafin's expanded form: per-head k [T, NH, 192], v [T, NH, 128].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deltafind.models.ops.attention import attend
from deltafind.models.ops.batch import Batch
from deltafind.models.ops.norm import RMSNorm


@dataclass(frozen=True)
class MLAOptions:
    hidden_size: int
    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    output_gate: bool = True  # mla_use_output_gate
    latent_norm_eps: float = 1e-5  # K3/deltafin: rms_norm_eps; transformers' Kimi Linear: 1e-6


class GatedNoPEMLA(nn.Module):
    def __init__(self, opts: MLAOptions, layer_idx: int) -> None:
        super().__init__()
        self.opts, self.layer_idx = opts, layer_idx
        h, nh = opts.hidden_size, opts.num_heads
        self.qk_dim = opts.qk_nope_head_dim + opts.qk_rope_head_dim
        if opts.q_lora_rank is None:
            self.q_proj = nn.Linear(h, nh * self.qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, opts.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(opts.q_lora_rank, opts.latent_norm_eps)
            self.q_b_proj = nn.Linear(opts.q_lora_rank, nh * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(
            h, opts.kv_lora_rank + opts.qk_rope_head_dim, bias=False
        )
        self.kv_a_layernorm = RMSNorm(opts.kv_lora_rank, opts.latent_norm_eps)
        self.kv_b_proj = nn.Linear(
            opts.kv_lora_rank, nh * (opts.qk_nope_head_dim + opts.v_head_dim), bias=False
        )
        if opts.output_gate:
            self.g_proj = nn.Linear(h, nh * opts.v_head_dim, bias=False)
        self.o_proj = nn.Linear(nh * opts.v_head_dim, h, bias=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, NH, qk], k [T, NH, qk], v [T, NH, v] for x [T, H]; no rotation anywhere."""
        o, t, nh = self.opts, x.shape[0], self.opts.num_heads
        q = (
            self.q_proj(x)
            if o.q_lora_rank is None
            else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        )
        q = q.view(t, nh, self.qk_dim)  # per head [nope | "rope" part], kept as one vector
        latent, k_pe = self.kv_a_proj_with_mqa(x).split(
            [o.kv_lora_rank, o.qk_rope_head_dim], dim=-1
        )
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(
            t, nh, o.qk_nope_head_dim + o.v_head_dim
        )
        k_nope, v = kv.split([o.qk_nope_head_dim, o.v_head_dim], dim=-1)
        k = torch.cat(
            (k_nope, k_pe[:, None, :].expand(t, nh, o.qk_rope_head_dim)), dim=-1
        )  # shared k_pe
        return q, k, v

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        """x [T, H] (input RMSNorm applied) -> [T, H]; appends k/v to each segment's cache."""
        t, nh, dv = x.shape[0], self.opts.num_heads, self.opts.v_head_dim
        q, k, v = self.project(x)
        out = attend(q, k, v, batch, self.layer_idx, scale=self.qk_dim**-0.5).reshape(
            t, nh * dv
        )  # [T, NH*V]
        if self.opts.output_gate:
            out = out * torch.sigmoid(
                self.g_proj(x)
            )  # gate from the attention input, before o_proj
        return self.o_proj(out)
