"""Kimi K3's config contract, quality guard and named switches (docs/kimi-k3-format.md §1 and §5.1, docs/kimi-k3-drafting-io.md §10).

`ModelArgs.from_config` reads a root `kimi_k3` config.json (or its `text_config`
alone), checks every key that changes the math, and refuses, with the reason,
anything that routes fewer than 16 experts, drops shared experts or swaps the
released weights for a lossy form. Sizes are free, so tiny synthetic stores load.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from deltafind.errors import UnsupportedModelError

TOP_K = 16
SHARED_EXPERTS = 2
MXFP4_SCHEME = {
    "num_bits": 4,
    "type": "float",
    "group_size": 32,
    "strategy": "group",
    "symmetric": True,
}
# Keys whose value is part of the model's definition (anything else is a different model).
CONTRACT = {
    "hidden_act": "situ",
    "moe_router_activation_func": "sigmoid",
    "topk_method": "noaux_tc",
    "mla_use_nope": True,
    "latent_moe_use_norm": True,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 0,
}


class QualityRefused(UnsupportedModelError):
    """A config or flag would run something other than K3 as released (fewer experts, lossy weights)."""


@dataclass
class ModelArgs:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    routed_expert_hidden_size: int
    num_hidden_layers: int
    num_experts: int
    num_experts_per_token: int
    num_attention_heads: int
    linear_attn_config: dict[str, Any]
    num_shared_experts: int = SHARED_EXPERTS
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    attn_res_block_size: int = 12
    first_k_dense_replace: int = 1
    moe_layer_freq: int = 1
    num_expert_group: int = 1
    topk_group: int = 1
    moe_renormalize: bool = True
    routed_scaling_factor: float = 1.0
    activation_situ_beta: float = 4.0
    activation_situ_linear_beta: float = 25.0
    mla_use_output_gate: bool = True
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False  # CONTRACT
    quantization_config: dict[str, Any] | None = None
    # Named switches (docs/kimi-k3.md, "Switches"): set as text_config keys or from_config(**switches).
    kda_a_log_per_channel: bool = True
    kda_a_form: str = "log"  # "neg_exp": the A_log tensor holds llama.cpp's A = -exp(A_log)
    kda_l2norm: str = "clamp"
    kda_prefill: str = "chunked"
    kda_chunk_size: int = 16
    mla_latent_norm_eps: float | None = None  # None: rms_norm_eps, as deltafin
    activation_dtype: str = "float32"
    mla_layers: frozenset[int] = field(default_factory=frozenset)  # 0-based, derived

    @classmethod
    def from_config(cls, config: dict[str, Any], **switches: Any) -> ModelArgs:
        text = _text_config(config)
        for key, want in CONTRACT.items():
            if key in text and text[key] != want:
                raise UnsupportedModelError(
                    f"kimi_k3 config has {key}={text[key]!r}; K3 is defined with {want!r}"
                )
        names = {f.name for f in dataclasses.fields(cls)} - {"mla_layers"}
        values = {k: v for k, v in text.items() if k in names}
        values.update(switches)
        check_quality(values)
        args = cls(**values)
        args.mla_layers = frozenset(_schedule(args))
        if args.kda_prefill not in ("chunked", "recurrent") or args.kda_l2norm not in (
            "clamp",
            "add_eps",
        ):
            raise UnsupportedModelError(
                f"kda_prefill={args.kda_prefill!r} / kda_l2norm={args.kda_l2norm!r} are not switch values"
            )
        if args.kda_a_form not in ("log", "neg_exp"):
            raise UnsupportedModelError(
                f"kda_a_form={args.kda_a_form!r}: use log (the release's A_log) or neg_exp "
                "(llama.cpp's ssm_a, A = -exp(A_log))"
            )
        if args.activation_dtype not in ("float32", "model"):
            raise UnsupportedModelError(
                f"activation_dtype={args.activation_dtype!r}: use float32 or model (the spine's dtype)"
            )
        return args

    def is_mla_layer(self, layer_idx: int) -> bool:
        return layer_idx in self.mla_layers

    def is_moe_layer(self, layer_idx: int) -> bool:
        return layer_idx >= self.first_k_dense_replace and layer_idx % self.moe_layer_freq == 0


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    if config.get("model_type") == "kimi_k3" or "text_config" in config:
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise UnsupportedModelError(
                "kimi_k3 config.json has no text_config object; is this the K3 checkpoint's config?"
            )
        if text.get("model_type", "kimi_linear") != "kimi_linear":
            raise UnsupportedModelError(
                f"kimi_k3 text_config.model_type is {text.get('model_type')!r}, expected 'kimi_linear'"
            )
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            if key in config and key in text and config[key] != text[key]:
                raise UnsupportedModelError(
                    f"kimi_k3 config: root {key}={config[key]} differs from text_config's {text[key]}"
                )
        return text
    return config


def _schedule(args: ModelArgs) -> set[int]:
    """0-based MLA layers from linear_attn_config's one-based lists (which must cover every layer once)."""
    la, n = args.linear_attn_config, args.num_hidden_layers
    kda, mla = set(la.get("kda_layers", [])), set(la.get("full_attn_layers", []))
    if kda & mla or kda | mla != set(range(1, n + 1)):
        raise UnsupportedModelError(
            f"kimi_k3 linear_attn_config: kda_layers and full_attn_layers must split layers 1..{n} (one-based) between them"
        )
    return {i - 1 for i in mla}


def check_quality(values: dict[str, Any]) -> None:
    """The quality guard on a K3 config (plus any overrides). Raises QualityRefused with the reason."""
    k = values.get("num_experts_per_token")
    if k != TOP_K:
        raise QualityRefused(
            f"kimi_k3 with num_experts_per_token={k}: K3 routes {TOP_K} experts per token, and deltafind does not "
            "run fewer (or more): a different expert count is a different, lower-quality model, not a tuning knob"
        )
    shared = values.get("num_shared_experts", SHARED_EXPERTS)
    if shared != SHARED_EXPERTS:
        raise QualityRefused(
            f"kimi_k3 with num_shared_experts={shared}: K3's two fused shared experts run on every token; "
            "dropping them changes every output"
        )
    q = values.get("quantization_config")
    if q is None:
        raise QualityRefused(
            "kimi_k3 config has no quantization_config: K3's routed experts ship as MXFP4, and "
            "deltafind runs them only in that exact form (re-import from the released checkpoint)"
        )
    weights = (q.get("config_groups") or {}).get("group_0", {}).get("weights", {})
    formats = {q.get("format"), (q.get("config_groups") or {}).get("group_0", {}).get("format")}
    bad = [
        f"{key}={weights.get(key)!r}"
        for key, want in MXFP4_SCHEME.items()
        if weights.get(key) != want
    ]
    if q.get("quant_method") != "compressed-tensors" or formats != {"mxfp4-pack-quantized"} or bad:
        raise QualityRefused(
            "kimi_k3 quantization_config is not the released compressed-tensors mxfp4-pack-quantized scheme "
            f"({', '.join(bad) or q.get('format')}): deltafind refuses re-encoded or more lossy expert weights"
        )


def check_load_dtype(dtype: torch.dtype | None) -> None:
    """The quality guard at load: fp16 cannot hold K3's bf16 weights exactly (range and rounding)."""
    if dtype is torch.float16:
        raise QualityRefused(
            "kimi_k3 loaded as float16: K3's weights are bfloat16 and float16 would round and clip them; "
            "use float32 (exact, the default) or bfloat16"
        )
