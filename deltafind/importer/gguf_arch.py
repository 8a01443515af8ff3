"""llama.cpp architectures deltafind imports from GGUF: metadata -> the family's config.json fields,
and the transformers tensor names each family reads (gguf-py's TensorNameMap gives their GGUF names).

Knows metadata keys and names, not files: importer/gguf_source.py reads the shards and tensors, and
Kimi K3, whose tensors the converter transforms, maps them itself (importer/gguf_k3.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from deltafind.errors import UnsupportedModelError
from deltafind.importer.gguf_k3 import k3_config, map_k3

Meta = Callable[
    ..., Any
]  # meta(key, default=REQUIRED) -> a GGUF field's value, the arch prefix added

_ATTN = (
    "model.layers.{bid}.input_layernorm",
    "model.layers.{bid}.post_attention_layernorm",
    "model.layers.{bid}.self_attn.o_proj",
)
_GQA = (
    "model.layers.{bid}.self_attn.q_proj",
    "model.layers.{bid}.self_attn.k_proj",
    "model.layers.{bid}.self_attn.v_proj",
)
_QK_NORM = ("model.layers.{bid}.self_attn.q_norm", "model.layers.{bid}.self_attn.k_norm")
_MLP = (
    "model.layers.{bid}.mlp.gate_proj",
    "model.layers.{bid}.mlp.up_proj",
    "model.layers.{bid}.mlp.down_proj",
)
# llama.cpp keeps a layer's experts as one 3-D tensor (`ffn_gate_exps`); these become mlp.experts.{e}.*_proj.
_EXPERTS = (
    "model.layers.{bid}.mlp.experts.gate_proj",
    "model.layers.{bid}.mlp.experts.up_proj",
    "model.layers.{bid}.mlp.experts.down_proj",
)
_ROUTER = ("model.layers.{bid}.mlp.gate",)
_MLA = (
    "model.layers.{bid}.self_attn.q_proj",
    "model.layers.{bid}.self_attn.q_a_proj",
    "model.layers.{bid}.self_attn.q_a_layernorm",
    "model.layers.{bid}.self_attn.q_b_proj",
    "model.layers.{bid}.self_attn.kv_a_proj_with_mqa",
    "model.layers.{bid}.self_attn.kv_a_layernorm",
    "model.layers.{bid}.self_attn.kv_b_proj",
    "model.layers.{bid}.self_attn.k_b_proj",
    "model.layers.{bid}.self_attn.v_b_proj",
)
_SHARED = (
    "model.layers.{bid}.mlp.shared_experts.gate_proj",
    "model.layers.{bid}.mlp.shared_experts.up_proj",
    "model.layers.{bid}.mlp.shared_experts.down_proj",
)
_GLOBAL = ("model.embed_tokens", "model.norm", "lm_head")


@dataclass(frozen=True)
class Arch:
    """One llama.cpp architecture: the family it becomes and how its metadata reads."""

    family: str  # deltafind's model_type
    architecture: str  # config.json's `architectures`: transformers' class
    hf_names: tuple[
        str, ...
    ]  # transformers module names ({bid} = layer), mapped to GGUF by gguf-py
    config: Callable[
        [Meta, dict[str, Any]], dict[str, Any]
    ]  # (meta, tensors' numpy views by GGUF name) -> config.json, less model_type and architectures
    rope_permuted: bool = False  # llama.cpp's converter interleaved q/k rows (undone at import)
    # (source, GGUF tensors by name) -> fills source.tensors/_load itself, instead of hf_names
    tensors: Callable[[Any, dict[str, Any]], None] | None = None
    gguf_arch: str = ""  # gguf.MODEL_ARCH member the installed gguf-py must have (capability probe)


def _common(meta: Meta) -> dict[str, Any]:
    n_head = int(meta("attention.head_count"))
    cfg = {
        "hidden_size": int(meta("embedding_length")),
        "num_hidden_layers": int(meta("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(meta("attention.head_count_kv", n_head)),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta("context_length", 2048)),
        "hidden_act": "silu",
    }
    if (ff := meta("feed_forward_length", None)) is not None:
        cfg["intermediate_size"] = int(ff)
    if (head_dim := meta("attention.key_length", None)) is not None:
        cfg["head_dim"] = int(head_dim)
    return cfg


def llama3_rope(factors: np.ndarray, theta: float, dim: int, original: int) -> dict[str, Any]:
    """transformers' llama3 rope_scaling that gives llama.cpp's `rope_freqs` (frequency divisors, one
    per rotated pair; the converter writes no parameters). Dims of divisor 1 are high-frequency, of the
    largest divisor low-frequency, and between them the divisor's inverse is linear in 1/wavelength,
    which fixes low/high_freq_factor for the given original length (any length gives the same rope)."""
    f = np.asarray(factors, dtype=np.float64)
    inv = 1.0 / theta ** (np.arange(0, dim, 2) / dim)
    if len(f) != len(inv):
        raise UnsupportedModelError(
            f"rope_freqs has {len(f)} values for a rope of {dim} dims; expected {len(inv)}"
        )
    factor = float(f.max())
    medium = (np.abs(f - 1) > 1e-6) & (np.abs(f - factor) > 1e-6 * factor)
    inv_wavelen = inv / (2 * math.pi)
    if medium.sum() >= 2:
        smooth = (1 / f[medium] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(inv_wavelen[medium], smooth, 1)
        low = -intercept * original / slope
        high = low + original / slope
    else:  # no smooth band: any cut between the two groups
        hi_min = inv_wavelen[np.abs(f - 1) <= 1e-6].min(initial=inv_wavelen.max() * 2)
        lo_max = inv_wavelen[np.abs(f - 1) > 1e-6].max(initial=0.0)
        low, high = original * lo_max * 1.0001, original * hi_min * 0.9999
    params = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": float(low),
        "high_freq_factor": float(high),
        "original_max_position_embeddings": original,
    }
    wavelen = 1 / inv_wavelen
    check = np.where(
        wavelen < original / high, 1.0, np.where(wavelen > original / low, factor, np.nan)
    )
    band = np.isnan(check)
    check[band] = 1 / (
        (1 - (original / wavelen[band] - low) / (high - low)) / factor
        + (original / wavelen[band] - low) / (high - low)
    )
    if not np.allclose(check, f, rtol=1e-4):
        raise UnsupportedModelError(
            "rope_freqs is not a Llama 3 frequency scaling (the only one deltafind reads from GGUF)"
        )
    return params


def _llama(meta: Meta, tensors: dict[str, Any]) -> dict[str, Any]:
    cfg = _common(meta)
    if "rope_freqs.weight" in tensors:
        dim = int(
            meta(
                "rope.dimension_count",
                cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            )
        )
        original = int(meta("rope.scaling.original_context_length", 8192))
        cfg["rope_scaling"] = llama3_rope(
            tensors["rope_freqs.weight"], cfg["rope_theta"], dim, original
        )
    if meta("expert_count", 0):
        raise UnsupportedModelError(
            "llama GGUFs with experts (Mixtral-style) are not supported; deltafind runs dense llama"
        )
    return cfg


def _qwen3moe(meta: Meta, tensors: dict[str, Any]) -> dict[str, Any]:
    cfg = _common(meta)
    cfg.setdefault("intermediate_size", int(meta("expert_feed_forward_length")))
    return {
        **cfg,
        "moe_intermediate_size": int(meta("expert_feed_forward_length")),
        "num_experts": int(meta("expert_count")),
        "num_experts_per_tok": int(meta("expert_used_count")),
        "norm_topk_prob": True,
    }  # llama.cpp's qwen3moe always renormalises the top-k (src/models/qwen3moe.cpp)


_SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID


def _deepseek2(meta: Meta, tensors: dict[str, Any]) -> dict[str, Any]:
    cfg = _common(meta)
    cfg.pop("head_dim", None)
    nextn = int(meta("nextn_predict_layers", 0))
    rope_dim, k_mla = int(meta("rope.dimension_count")), int(meta("attention.key_length_mla"))
    if int(meta("expert_gating_func", 0)) != _SIGMOID:
        raise UnsupportedModelError(
            "deepseek2 GGUFs with softmax routing (DeepSeek-V2) are not supported; deltafind runs "
            "DeepSeek-V3/R1 and Kimi K2 (expert_gating_func = sigmoid)"
        )
    cfg.update(
        {
            "num_hidden_layers": cfg["num_hidden_layers"] - nextn,
            "num_nextn_predict_layers": 0,
            "num_key_value_heads": cfg[
                "num_attention_heads"
            ],  # the converter writes 1 (MLA as MQA); HF counts heads
            "q_lora_rank": meta("attention.q_lora_rank", None),
            "kv_lora_rank": int(meta("attention.kv_lora_rank")),
            "qk_rope_head_dim": rope_dim,
            "qk_nope_head_dim": k_mla - rope_dim,
            "v_head_dim": int(meta("attention.value_length_mla")),
            "first_k_dense_replace": int(meta("leading_dense_block_count", 0)),
            "moe_intermediate_size": int(meta("expert_feed_forward_length")),
            "n_routed_experts": int(meta("expert_count")),
            "num_experts_per_tok": int(meta("expert_used_count")),
            "n_shared_experts": int(meta("expert_shared_count", 0)),
            "routed_scaling_factor": float(meta("expert_weights_scale", 1.0)),
            "norm_topk_prob": bool(meta("expert_weights_norm", False)),
            "n_group": int(meta("expert_group_count", 0)) or 1,
            "topk_group": int(meta("expert_group_used_count", 0)) or 1,
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
        }
    )
    cfg.setdefault("intermediate_size", cfg["moe_intermediate_size"])
    if cfg["q_lora_rank"] is not None:
        cfg["q_lora_rank"] = int(cfg["q_lora_rank"])
    if meta("rope.scaling.type", "none") == "yarn":
        # the converter writes 0.1 x mscale_all_dim (llama.cpp's src/models/deepseek2.cpp undoes it) and not
        # mscale; llama.cpp's attention scaling is HF's with mscale = mscale_all_dim (DeepSeek-V3's and Kimi K2's)
        mscale_all_dim = float(meta("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
        cfg["rope_scaling"] = {
            "rope_type": "yarn",
            "factor": float(meta("rope.scaling.factor")),
            "original_max_position_embeddings": int(meta("rope.scaling.original_context_length")),
            "beta_fast": float(meta("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(meta("rope.scaling.yarn_beta_slow", 1.0)),
            "mscale": mscale_all_dim,
            "mscale_all_dim": mscale_all_dim,
        }
    return cfg


ARCHES = {
    "llama": Arch(
        "llama", "LlamaForCausalLM", _GLOBAL + _ATTN + _GQA + _MLP, _llama, rope_permuted=True
    ),
    "qwen2": Arch(  # q/k/v biases: `attn_q.bias`, named by suffix
        "qwen2", "Qwen2ForCausalLM", _GLOBAL + _ATTN + _GQA + _MLP, lambda meta, _: _common(meta)
    ),
    "qwen3": Arch(
        "qwen3",
        "Qwen3ForCausalLM",
        _GLOBAL + _ATTN + _GQA + _QK_NORM + _MLP,
        lambda meta, _: _common(meta),
    ),
    "qwen3moe": Arch(
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        _GLOBAL + _ATTN + _GQA + _QK_NORM + _MLP + _EXPERTS + _ROUTER,
        _qwen3moe,
    ),
    "deepseek2": Arch(
        "deepseek_v3",
        "DeepseekV3ForCausalLM",
        _GLOBAL
        + _ATTN
        + _MLA
        + _MLP
        + _EXPERTS
        + _ROUTER
        + _SHARED
        + ("model.layers.{bid}.mlp.gate.e_score_correction",),
        _deepseek2,
    ),
    "kimi-k3": Arch(
        "kimi_k3",
        "KimiK3ForConditionalGeneration",
        (),
        k3_config,
        tensors=map_k3,
        gguf_arch="KIMI_K3",
    ),
}


def arch_for(name: str, where: str) -> Arch:
    arch = ARCHES.get(name)
    if arch is None:
        raise UnsupportedModelError(
            f"{where}: GGUF architecture {name!r} is not supported (supported: "
            f"{', '.join(sorted(ARCHES))})"
        )
    import gguf

    # probe the tables, never the version: llama.cpp's own gguf-py and PyPI's share version strings
    if arch.gguf_arch and not hasattr(gguf.MODEL_ARCH, arch.gguf_arch):
        raise UnsupportedModelError(
            f"{where}: GGUF architecture {name!r} needs gguf-py's {arch.gguf_arch} tables, and the gguf "
            f"installed ({gguf.__file__}) has none (PyPI's gguf lacks them): install llama.cpp's own "
            "gguf-py (`make dev` in a deltafind checkout does; elsewhere `pip install --no-deps "
            "LLAMA_CPP/gguf-py` from llama.cpp's source), or import the model's HuggingFace folder"
        )
    return arch
