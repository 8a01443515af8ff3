"""The decoder skeleton shared by the Llama-style families (llama, qwen3, qwen3_moe) and DeepSeek-V3.

A family module picks its attention options and MLP per layer; this owns the
embedding -> layers -> norm -> head flow, HF parameter names, reading ModelArgs
from config.json and the routed-expert layer around a family's router.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import torch
from torch import nn

from deltafind.models.contract import FamilyModel, RoutedExperts
from deltafind.models.ops.attention import AttnStep, attend
from deltafind.models.ops.batch import Batch
from deltafind.models.ops.gated_mlp import swiglu
from deltafind.models.ops.moe import SlicedMLP, dispatch
from deltafind.models.ops.norm import RMSNorm
from deltafind.models.ops.rope import Rope, apply_rope, rope_parameters, rope_tables
from deltafind.models.ops.step import DecodeChain, run_layers
from deltafind.models.ops.stored import FusedLinear
from deltafind.provider import Expert, ExpertProvider

A = TypeVar("A")


@dataclass(kw_only=True)
class DecoderArgs:
    """The config.json fields every family on this skeleton reads (contract.py's FamilyArgs among them); a
    family's ModelArgs adds its own, may change a default, and checks and derives in `__post_init__`.

    `from_config` keeps the keys the dataclass has, takes `rope` in transformers 5's normalised form, and
    fills a field the config leaves out from its `ALIASES` spelling (another spelling -> the field's name).
    """

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
    hidden_act: str = "silu"
    rope: dict[str, Any] = dataclasses.field(default_factory=dict)
    ALIASES: ClassVar[dict[str, str]] = {}

    def __post_init__(self) -> None:  # the fields HF configs leave implicit
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_config(cls: type[A], config: dict[str, Any]) -> A:
        config = {
            **{name: config[alias] for alias, name in cls.ALIASES.items() if alias in config},
            **config,
        }  # type: ignore[attr-defined]
        names = {f.name for f in dataclasses.fields(cls)} - {"rope"}  # type: ignore[arg-type]
        return cls(**{k: v for k, v in config.items() if k in names}, rope=rope_parameters(config))


class Attention(nn.Module):
    """Grouped-query attention with rope and optional per-head q/k RMSNorm (Qwen3)."""

    def __init__(self, args: Any, layer_idx: int, qk_norm: bool = False) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.head_dim = args.head_dim
        h, d, bias = args.hidden_size, args.head_dim, args.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)
        if qk_norm:
            self.q_norm = RMSNorm(d, args.rms_norm_eps)
            self.k_norm = RMSNorm(d, args.rms_norm_eps)
        self.qk_norm = qk_norm
        self._qkv = FusedLinear()  # q, k and v in one stored-format matmul where the kernel applies

    def forward(
        self, x: torch.Tensor, batch: Batch, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        t, hq, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        mods = (self.q_proj, self.k_proj, self.v_proj)
        qkv = self._qkv(
            x, [m.weight for m in mods], [getattr(m, "quant", "") for m in mods]
        )  # [T, (Hq + 2 Hkv) D]
        if qkv is None:  # the per-matrix path (widened weights, GPU, no compiler)
            qkv = torch.cat([m(x) for m in mods], dim=1)
        elif self.q_proj.bias is not None:
            qkv += torch.cat([m.bias for m in mods])
        heads = qkv.view(t, hq + 2 * hkv, d)
        v = heads[:, hq + hkv :]  # [T, Hkv, D]
        if self.qk_norm:
            q, k = self.q_norm(heads[:, :hq]), self.k_norm(heads[:, hq : hq + hkv])
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        else:
            qk = apply_rope(heads[:, : hq + hkv], cos, sin)  # PERF: q and k rotated in one pass
            q, k = qk[:, :hq], qk[:, hq:]  # [T, Hq, D], [T, Hkv, D]
        o = attend(q, k, v, batch, self.layer_idx, scale=d**-0.5)
        return self.o_proj(o.reshape(t, hq * d))


class RoutedMoE(RoutedExperts):
    """Routed experts from the provider, chosen per token by `gate` (HF `mlp.gate`: ids [T, k], weights [T, k])."""

    def __init__(
        self, gate: nn.Module, layer_idx: int, experts: ExpertProvider, hidden_act: str
    ) -> None:
        super().__init__()
        self.gate = gate
        self.layer_idx, self.provider = layer_idx, experts
        self.run = swiglu(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        idx, weight = self.gate(x)
        return dispatch(x, idx, weight, self.provider, self.layer_idx, self.run)


class DecoderLayer(nn.Module):
    def __init__(self, args: Any, attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = mlp
        # One decode token's attention half in one kernel call; a plain attribute (not a submodule)
        self._attn_step = (
            AttnStep(self.input_layernorm, attn) if isinstance(attn, Attention) else None
        )
        # The MLP and its norm as plain attributes too: a submodule through nn.Module.__getattr__ costs
        # ~1 us a lookup, and each decode token made four a layer (the modules are never reassigned)
        self._ffn = (mlp, self.post_attention_layernorm, isinstance(mlp, SlicedMLP))

    def attend(
        self, x: torch.Tensor, batch: Batch, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        if self._attn_step is not None and (y := self._attn_step(x, batch, cos, sin)) is not None:
            return y
        return x + self.self_attn(self.input_layernorm(x), batch, cos, sin)

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        mlp, norm, sliced = self._ffn
        if sliced:
            return mlp.forward(
                h, norm
            )  # the norm and the sum inside its kernel call (a module with no hooks)
        # modules with no hooks: forward, not through nn.Module.__call__
        return h + mlp.forward(norm.forward(h))

    def chain_parts(
        self, slices: Sequence[Expert], caches: Sequence[Any], cols: int, d: int
    ) -> tuple[Any, ...] | None:
        """What ops/step.py's DecodeChain runs this layer with for one token of hidden size `cols` and rope
        dim `d`, its dense MLP held as `slices`: (attention plan, (gate/up, down) parts, norm, activation,
        cache row), or None where the layer's kernels do not take it."""
        step, (mlp, norm, sliced) = self._attn_step, self._ffn
        if (
            step is None
            or not sliced
            or (attn := step.plan()) is None
            or attn.d != d
            or (parts := mlp.run.held_parts(slices, norm, cols)) is None
            or (row := step.cache_row(caches)) is None
        ):
            return None
        return attn, parts, norm, mlp.run.act, row

    def weight_slots(self) -> list[tuple[dict[str, Any], str]]:
        """Where each of this layer's weights lives (a module's parameters dict, the name): a chain planned
        on them checks each by identity before it runs (a reloaded weight is a new object)."""
        return [(m._parameters, name) for m in self.modules() for name in m._parameters]

    def predict_experts(self, h: torch.Tensor) -> list[int]:
        """This layer's likely experts for hidden state h (its own norm and router; every slice if dense)."""
        mlp, norm, sliced = self._ffn
        # a dense layer's: every slice, whatever h is
        return mlp.predict(h if sliced else norm.forward(h))


class Backbone(nn.Module):
    def __init__(self, args: Any, make_layer: Callable[[int], nn.Module]) -> None:
        super().__init__()
        # _weight: no random init (on the meta device it imported torch._dynamo: +69 MiB RSS, RESULTS.md)
        self.embed_tokens = nn.Embedding(
            args.vocab_size,
            args.hidden_size,
            _weight=torch.empty(args.vocab_size, args.hidden_size),
        )
        self.layers = nn.ModuleList(make_layer(i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class CausalLM(FamilyModel):
    """embed -> layers -> norm -> lm_head, over a `Batch` of segments."""

    def __init__(
        self, args: Any, make_layer: Callable[[int], nn.Module], rope: Rope, experts: ExpertProvider
    ) -> None:
        super().__init__()
        self.args, self.experts = args, experts
        self.model = Backbone(args, make_layer)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        self.rope = rope
        self._chain = (
            DecodeChain()
        )  # a decode token's layers in one kernel call, where they all allow it (ops/step.py)

    def tie_weights(self) -> None:
        self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        batch: Batch,
        all_logits: bool = False,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)  # [T, H]
        cos, sin = rope_tables(
            *self.rope.cos_sin(batch.positions)
        )  # [T, 1, D]: shaped once, not per layer
        layers = self.model.layers if num_layers is None else self.model.layers[:num_layers]

        first = (
            layers[0].mlp.predict(x) if isinstance(layers[0].mlp, SlicedMLP) else None
        )  # else the last route
        x = run_layers(
            self.experts,
            batch,
            layers,
            x,
            first,
            lambda i, layer, x: layer.attend(x, batch, cos, sin),
            lambda i, layer, h: layer.feed_forward(h),
            lambda x: self._chain(layers, self.experts, x, batch, cos, sin),
        )
        batch.advance()
        # else x is their last
        if not all_logits and (batch.logit_rows or any(s.num_tokens != 1 for s in batch.segments)):
            x = x[batch.last_token_index().to(x.device)]
        return self.lm_head(self.model.norm(x)).float()


def make_rope(args: Any, dim: int | None = None) -> Rope:
    with torch.device("cpu"):
        return Rope(args.rope, dim or args.head_dim, args.max_position_embeddings)
