"""Kimi K3 (`model_type kimi_k3`, text model `kimi_linear`), unmodified: docs/kimi-k3-format.md §1-5.

Block AttnRes instead of a residual stream; KDA on 69 layers and gated NoPE MLA
on 24; SiTU; a dense layer 0; Latent MoE with 16 of 896 MXFP4 experts plus two
fused shared experts. Activations fp32. The config contract, quality guard and
named switches live in kimi_k3_config.py; docs/kimi-k3.md lists the switches.
"""

from __future__ import annotations

import re
from functools import partial

import torch
from torch import nn

from deltafind.models.contract import FamilyModel
from deltafind.models.kimi_k3_config import ModelArgs, check_load_dtype
from deltafind.models.ops.attnres import AttnResStream
from deltafind.models.ops.batch import Batch
from deltafind.models.ops.gated_mlp import GatedExpert
from deltafind.models.ops.kda_layer import KDAOptions, KimiDeltaAttention
from deltafind.models.ops.latent_moe import LatentMoE, SigmoidRouter
from deltafind.models.ops.mla_nope import GatedNoPEMLA, MLAOptions
from deltafind.models.ops.moe import SlicedMLP
from deltafind.models.ops.norm import RMSNorm
from deltafind.models.ops.situ import situ
from deltafind.models.ops.step import run_layers
from deltafind.provider import HF_WEIGHTS, ExpertProvider, WeightNames

__all__ = ["MXFP4_RECORD", "WEIGHTS", "Model", "ModelArgs", "weight_names"]
MXFP4_RECORD = tuple(
    f"{w}.weight_{k}" for w in ("w1", "w2", "w3") for k in ("packed", "scale")
)  # the release's byte order
# Routed experts are compressed-tensors MXFP4 packs under `block_sparse_moe`, kept exactly as released;
# layer 0's dense MLP has transformers' names.
WEIGHTS = WeightNames(
    routed=re.compile(
        r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.((?:w1|w2|w3)\.weight_(?:packed|scale))"
    ),
    dense=HF_WEIGHTS.dense,
    layouts=(MXFP4_RECORD, *HF_WEIGHTS.layouts),
)


def kda_options(args: ModelArgs) -> KDAOptions:
    la = args.linear_attn_config
    return KDAOptions(
        hidden_size=args.hidden_size,
        num_heads=la["num_heads"],
        head_dim=la["head_dim"],
        conv_size=la.get("short_conv_kernel_size", 4),
        full_rank_gate=bool(la.get("use_full_rank_gate", True)),
        gate_lower_bound=la.get("gate_lower_bound", -5.0),
        a_log_per_channel=args.kda_a_log_per_channel,
        a_form=args.kda_a_form,
        l2norm=args.kda_l2norm,
        norm_eps=args.rms_norm_eps,
        prefill=args.kda_prefill,
        chunk_size=args.kda_chunk_size,
    )


def mla_options(args: ModelArgs) -> MLAOptions:
    return MLAOptions(
        hidden_size=args.hidden_size,
        num_heads=args.num_attention_heads,
        q_lora_rank=args.q_lora_rank,
        kv_lora_rank=args.kv_lora_rank,
        qk_nope_head_dim=args.qk_nope_head_dim,
        qk_rope_head_dim=args.qk_rope_head_dim,
        v_head_dim=args.v_head_dim,
        output_gate=args.mla_use_output_gate,
        latent_norm_eps=args.rms_norm_eps
        if args.mla_latent_norm_eps is None
        else args.mla_latent_norm_eps,
    )


class ResWeights(nn.Module):
    """An AttnRes sub-layer's `<side>_res_norm.weight` [H] and `<side>_res_proj.weight` [1, H]."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, hidden))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int, experts: ExpertProvider) -> None:
        super().__init__()
        h, eps = args.hidden_size, args.rms_norm_eps
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.self_attention_res_norm, self.mlp_res_norm = RMSNorm(h, eps), RMSNorm(h, eps)
        self.self_attention_res_proj, self.mlp_res_proj = ResWeights(h), ResWeights(h)
        self.is_mla = args.is_mla_layer(layer_idx)
        self.self_attn = (
            GatedNoPEMLA(mla_options(args), layer_idx)
            if self.is_mla
            else KimiDeltaAttention(kda_options(args), layer_idx)
        )
        beta, lbeta = args.activation_situ_beta, args.activation_situ_linear_beta
        if args.is_moe_layer(layer_idx):
            router = SigmoidRouter(
                h,
                args.num_experts,
                args.num_experts_per_token,
                args.num_expert_group,
                args.topk_group,
                args.moe_renormalize,
                args.routed_scaling_factor,
            )
            self.block_sparse_moe = LatentMoE(
                h,
                args.routed_expert_hidden_size,
                args.moe_intermediate_size * args.num_shared_experts,
                router,
                layer_idx,
                experts,
                eps,
                beta,
                lbeta,
            )
        else:
            situ_glu = partial(situ, beta=beta, linear_beta=lbeta)
            self.mlp = SlicedMLP(
                layer_idx, experts, GatedExpert(situ_glu)
            )  # dense: slices in the store

    def ffn(self) -> nn.Module:
        return self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp

    def predict_experts(self, y: torch.Tensor) -> list[int]:
        """This layer's likely experts from an earlier mixture y (PILOT, docs/kimi-k3-drafting-io.md §8.2); all slices if dense."""
        ffn = self.ffn()
        return ffn.predict(self.post_attention_layernorm(y) if isinstance(ffn, LatentMoE) else y)


class Backbone(nn.Module):
    def __init__(self, args: ModelArgs, experts: ExpertProvider) -> None:
        super().__init__()
        h = args.hidden_size
        self.embed_tokens = nn.Embedding(
            args.vocab_size, h, _weight=torch.empty(args.vocab_size, h)
        )  # no init: see transformer.py
        self.layers = nn.ModuleList(
            DecoderLayer(args, i, experts) for i in range(args.num_hidden_layers)
        )
        self.norm = RMSNorm(h, args.rms_norm_eps)
        self.output_attn_res_norm = RMSNorm(h, args.rms_norm_eps)
        self.output_attn_res_proj = ResWeights(h)


class Model(FamilyModel):
    """embed -> 93 AttnRes-mixed layers -> output mixture -> norm -> lm_head, over a `Batch`."""

    layer_prefix = False  # the output mixture reads every AttnRes block: no layer-skip self-draft

    def __init__(self, args: ModelArgs, experts: ExpertProvider) -> None:
        super().__init__()
        check_load_dtype(experts.dtype)  # the quality guard's half that sees the load
        self.args, self.experts = args, experts
        self.model = Backbone(args, experts)
        self.recurrent = any(isinstance(m, KimiDeltaAttention) for m in self.modules())
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        batch: Batch,
        all_logits: bool = False,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        m, eps, layers = self.model, self.args.rms_norm_eps, self.model.layers
        h0 = m.embed_tokens(
            input_ids
        )  # the compute dtype (a bf16 table stays bf16: models/ops/stored.py)
        dtype = torch.float32 if self.args.activation_dtype == "float32" else h0.dtype
        stream = AttnResStream(h0.to(dtype), self.args.attn_res_block_size)  # [T, H], unscaled

        def attend(i: int, layer: DecoderLayer, h: torch.Tensor) -> torch.Tensor:
            x = stream.attention_input(
                i, layer.self_attention_res_norm.weight, layer.self_attention_res_proj.weight, eps
            )
            stream.add_attention(layer.self_attn(layer.input_layernorm(x), batch))
            return stream.mlp_input(
                layer.mlp_res_norm.weight, layer.mlp_res_proj.weight, eps
            )  # PILOT predicts from it

        def feed_forward(i: int, layer: DecoderLayer, y: torch.Tensor) -> torch.Tensor:
            stream.add_mlp(layer.ffn()(layer.post_attention_layernorm(y)))
            return stream.h  # DSpark (docs/kimi-k3-drafting-io.md §7.3) captures the AttnRes partial block sum; never modified in place

        run_layers(
            self.experts,
            batch,
            layers,
            stream.h,
            layers[0].predict_experts(stream.h),
            attend,
            feed_forward,
        )
        z = stream.output(m.output_attn_res_norm.weight, m.output_attn_res_proj.weight, eps)
        batch.advance()
        if not all_logits:
            z = z[batch.last_token_index().to(z.device)]
        return self.lm_head(m.norm(z).to(dtype)).float()


def weight_names(args: ModelArgs) -> WeightNames:
    return WEIGHTS  # num_nextn_predict_layers is 0 (docs/kimi-k3-format.md §2): nothing to drop
