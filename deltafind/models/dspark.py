"""DSpark, Kimi K3's block drafter (docs/kimi-k3-drafting-io.md §7.2-7.5), in bf16 as the checkpoint was trained.

Five decoder layers (absorbed MLA with interleaved YaRN rotation and no mask,
SiLU MLP) read a context built from K3's captured hidden states and propose up
to 7 tokens in one pass, chained through a low-rank Markov head. It borrows
K3's token embedding and lm_head and never loads its own embed_tokens copy.
Owns the math and the per-sequence context cache; knows nothing of stores,
sessions or the verifier (engine/draft/dspark.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deltafind.errors import UnsupportedModelError
from deltafind.models.ops.batch import LayerCache
from deltafind.models.ops.moe import DenseMLP
from deltafind.models.ops.rope import inv_freq_and_scale, rope_parameters, yarn_get_mscale

BF16 = torch.bfloat16
BLOCK = 7  # query rows of a proposal: the pending token and six mask tokens (docs/kimi-k3-drafting-io.md §7.4)


@dataclass(frozen=True)
class ModelArgs:
    """The DSpark `config.json` keys the math reads (the importer checks the rest)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    vocab_size: int
    rms_norm_eps: float
    target_hidden_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    markov_rank: int
    max_position_embeddings: int
    rope: dict[str, Any]

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> ModelArgs:
        names = [n for n in cls.__dataclass_fields__ if n != "rope"]
        missing = [n for n in names if n not in cfg]
        if missing:
            raise UnsupportedModelError(
                f"DSpark config.json lacks {', '.join(missing)}; re-import the checkpoint with `deltafind setup --dspark`"
            )
        rope = rope_parameters(cfg)
        if rope["rope_type"] != "yarn":
            raise UnsupportedModelError(
                f"DSpark rope_type is {rope['rope_type']!r}; docs/kimi-k3-drafting-io.md §7.5 needs yarn"
            )
        values = {n: cfg[n] for n in names}
        values["target_layer_ids"] = tuple(int(i) for i in cfg["target_layer_ids"])
        return cls(**values, rope=rope)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def softmax_scale(self) -> float:
        """qk_head_dim^-0.5 * mscale^2, mscale = yarn_mscale(factor, mscale_all_dim) (docs/kimi-k3-drafting-io.md §7.5)."""
        all_dim = self.rope.get("mscale_all_dim")
        m = yarn_get_mscale(float(self.rope.get("factor", 1.0)), float(all_dim)) if all_dim else 1.0
        return self.qk_head_dim**-0.5 * m * m


def rmsnorm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Widen to fp32, normalise, cast to bf16, then multiply by the bf16 weight (docs/kimi-k3-drafting-io.md §7.2)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(BF16) * weight


def yarn_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (2i, 2i+1) of x [T, ..., d] by cos/sin [T, d/2]; fp32 math, bf16 out."""
    xf = x.float().unflatten(-1, (-1, 2))  # [T, ..., d/2, 2]
    x0, x1 = xf[..., 0], xf[..., 1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    c, s = cos.view(shape), sin.view(shape)
    return torch.stack((x0 * c - x1 * s, x1 * c + x0 * s), dim=-1).flatten(-2).to(BF16)


class YarnRope:
    """cos/sin of YaRN's inverse frequencies (docs/kimi-k3-drafting-io.md §7.5) at absolute positions."""

    def __init__(self, args: ModelArgs) -> None:
        self.inv_freq, self.scale = inv_freq_and_scale(
            args.rope, args.qk_rope_head_dim, args.max_position_embeddings
        )

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angle = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]  # [T, d/2]
        return angle.cos() * self.scale, angle.sin() * self.scale


class Context:
    """One sequence's DSpark context: per layer, the latent [L, kv_lora] and rotated pe [L, rope] rows (bf16)."""

    def __init__(self, num_layers: int) -> None:
        self.layers = [LayerCache() for _ in range(num_layers)]
        self.length = 0

    def truncate(self, length: int) -> None:
        """Forget context rows from `length` on (the target rolled back, or the session restarts)."""
        if not 0 <= length <= self.length:
            raise ValueError(
                f"DSpark context holds {self.length} rows; cannot truncate to {length}"
            )
        for layer in self.layers:
            layer.truncate(length)
        self.length = length


def _norm(dim: int) -> nn.Module:
    """A norm's `weight` [dim] under the checkpoint's name (the math is `rmsnorm_bf16`)."""
    m = nn.Module()
    m.weight = nn.Parameter(torch.empty(dim))
    return m


class MLA(nn.Module):
    """DSpark's MLA in the absorbed form: queries meet the cached latents directly, no mask."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        h, nh = args.hidden_size, args.num_attention_heads
        self.args = args
        self.q_a_proj = nn.Linear(h, args.q_lora_rank, bias=False)
        self.q_a_layernorm = _norm(args.q_lora_rank)
        self.q_b_proj = nn.Linear(args.q_lora_rank, nh * args.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(
            h, args.kv_lora_rank + args.qk_rope_head_dim, bias=False
        )
        self.kv_a_layernorm = _norm(args.kv_lora_rank)
        self.kv_b_proj = nn.Linear(
            args.kv_lora_rank, nh * (args.qk_nope_head_dim + args.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(nh * args.v_head_dim, h, bias=False)

    def latent(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(normalised latent [T, kv_lora], rotated pe [T, rope]) of rows x [T, H]."""
        a = self.args
        kv = self.kv_a_proj_with_mqa(x)  # [T, kv_lora + rope]
        lat = rmsnorm_bf16(kv[:, : a.kv_lora_rank], self.kv_a_layernorm.weight, a.rms_norm_eps)
        return lat, yarn_rotate(kv[:, a.kv_lora_rank :], cos, sin)

    def forward(
        self, n: torch.Tensor, ctx: LayerCache, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """Query rows n [R, H] attend to every context row and every query row -> [R, H]."""
        a, r = self.args, n.shape[0]
        nh, dn, dv, kvr = a.num_attention_heads, a.qk_nope_head_dim, a.v_head_dim, a.kv_lora_rank
        q = self.q_b_proj(
            rmsnorm_bf16(self.q_a_proj(n), self.q_a_layernorm.weight, a.rms_norm_eps)
        ).view(r, nh, a.qk_head_dim)
        q_nope, q_pe = q[..., :dn], yarn_rotate(q[..., dn:], cos, sin)  # [R, NH, dn], [R, NH, rope]
        lat_q, pe_q = self.latent(n, cos, sin)
        if ctx.length:
            lat_c, pe_c = ctx.view()  # [L, kv_lora], [L, rope]
            lat, pe = (
                torch.cat([lat_c, lat_q]),
                torch.cat([pe_c, pe_q]),
            )  # [L+R, kv_lora], [L+R, rope]
        else:
            lat, pe = lat_q, pe_q  # query rows are never kept (docs/kimi-k3-drafting-io.md §7.4.6)
        wkv = self.kv_b_proj.weight.view(nh, dn + dv, kvr)
        w_uk, w_uv = wkv[:, :dn], wkv[:, dn:]  # [NH, dn, kv_lora], [NH, dv, kv_lora]
        q_lat = torch.einsum("rhd,hdc->rhc", q_nope, w_uk)  # [R, NH, kv_lora]
        scores = torch.einsum("rhc,lc->hrl", q_lat, lat) + torch.einsum(
            "rhp,lp->hrl", q_pe, pe
        )  # [NH, R, L+R]
        p = torch.softmax(scores.float() * a.softmax_scale(), dim=-1).to(BF16)
        o_lat = torch.einsum("hrl,lc->rhc", p, lat)  # [R, NH, kv_lora]
        out = torch.einsum("rhc,hvc->rhv", o_lat, w_uv)  # [R, NH, dv]
        return self.o_proj(out.reshape(r, nh * dv))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.input_layernorm = _norm(args.hidden_size)
        self.post_attention_layernorm = _norm(args.hidden_size)
        self.self_attn = MLA(args)
        self.mlp = DenseMLP(
            args.hidden_size, args.intermediate_size, F.silu
        )  # down(silu(gate x) * up x): SiLU, not SiTU


class MarkovHead(nn.Module):
    def __init__(self, vocab: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = nn.Linear(
            rank, vocab, bias=False
        )  # weight [V, rank]: the previous token's embedding
        self.markov_w2 = nn.Linear(rank, vocab, bias=False)  # weight [V, rank]: the output factor


class ConfidenceHead(nn.Module):
    def __init__(self, hidden: int, rank: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden + rank, 1)


@dataclass
class Draft:
    """One proposal: `tokens` [w] and each row's confidence logit [w] (computed, not used: docs/kimi-k3-drafting-io.md §7.4.5)."""

    tokens: list[int]
    confidence: torch.Tensor


class Model(nn.Module):
    """DSpark's tensors under the checkpoint's names (no prefix), bf16; `attach` supplies K3's embedding and lm_head."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        h = args.hidden_size
        self.context_proj = nn.Linear(
            len(args.target_layer_ids) * args.target_hidden_size, h, bias=False
        )
        self.context_norm, self.final_norm = _norm(h), _norm(h)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_hidden_layers))
        self.markov_head = MarkovHead(args.vocab_size, args.markov_rank)
        self.confidence_head = ConfidenceHead(h, args.markov_rank)
        with torch.device("cpu"):  # real tables even when the weights are built on meta
            self.rope = YarnRope(args)
        self._target: tuple[torch.Tensor, nn.Module] | None = None

    def attach(self, embed_weight: torch.Tensor, lm_head: nn.Module) -> None:
        """Borrow K3's embedding table [V, H] and lm_head (kept out of this module's state_dict)."""
        if tuple(embed_weight.shape) != (self.args.vocab_size, self.args.hidden_size):
            raise UnsupportedModelError(
                f"DSpark expects a target embedding [{self.args.vocab_size}, {self.args.hidden_size}], the target has {list(embed_weight.shape)}"
            )
        self._target = (embed_weight, lm_head)

    def new_context(self) -> Context:
        return Context(len(self.layers))

    def extend(self, ctx: Context, rows: torch.Tensor) -> None:
        """Append context rows for the next target positions: rows [n, len(target_layer_ids) * H_target]."""
        a = self.args
        pos = torch.arange(ctx.length, ctx.length + rows.shape[0], device=rows.device)
        cos, sin = self.rope.cos_sin(pos)
        c = rmsnorm_bf16(
            self.context_proj(rows.to(BF16)), self.context_norm.weight, a.rms_norm_eps
        )  # [n, H]
        for layer, cache in zip(self.layers, ctx.layers, strict=True):
            cache.append(*layer.self_attn.latent(c, cos, sin))
        ctx.length += rows.shape[0]

    def hidden(self, ctx: Context, pending: int) -> torch.Tensor:
        """The final-norm output [7, H] of the query rows [pending, M x 6] at positions L..L+6."""
        assert self._target is not None, "attach K3's embedding and lm_head first"
        a, embed = self.args, self._target[0]
        ids = torch.tensor([pending] + [a.mask_token_id] * (BLOCK - 1), device=embed.device)
        hidden = F.embedding(ids, embed).to(BF16)  # [7, H]
        cos, sin = self.rope.cos_sin(
            torch.arange(ctx.length, ctx.length + BLOCK, device=embed.device)
        )
        residual: torch.Tensor | None = None
        for layer, cache in zip(self.layers, ctx.layers, strict=True):
            acc = hidden if residual is None else residual + hidden
            n = rmsnorm_bf16(acc, layer.input_layernorm.weight, a.rms_norm_eps)
            acc = acc + layer.self_attn(n, cache, cos, sin)
            hidden, residual = (
                layer.mlp(rmsnorm_bf16(acc, layer.post_attention_layernorm.weight, a.rms_norm_eps)),
                acc,
            )
        assert residual is not None
        return rmsnorm_bf16(residual + hidden, self.final_norm.weight, a.rms_norm_eps)

    def propose(self, ctx: Context, pending: int, width: int) -> Draft:
        """Up to `width` (1..7) greedy tokens after `pending`, the Markov head chaining each on the previous."""
        assert self._target is not None, "attach K3's embedding and lm_head first"
        if not 1 <= width <= BLOCK:
            raise ValueError(f"DSpark proposes 1..{BLOCK} tokens (asked {width})")
        lm_head = self._target[1]
        out = self.hidden(ctx, pending)[:width]  # [w, H]
        logits = lm_head(out.to(lm_head.weight.dtype)).float()  # [w, V]: K3's head, fp32
        w1, w2 = self.markov_head.markov_w1.weight, self.markov_head.markov_w2.weight  # [V, rank]
        tokens, conf, prev = [], [], pending
        for r in range(width):
            e = w1[prev]  # [rank]
            bias = F.linear(e, w2)  # [V] bf16
            conf.append(self.confidence_head.proj(torch.cat([out[r], e])))  # [1]
            prev = int(torch.argmax(logits[r] + bias.float()))
            tokens.append(prev)
        return Draft(tokens, torch.cat(conf).float())
