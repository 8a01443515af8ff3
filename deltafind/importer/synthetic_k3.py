"""Synthetic Kimi K3 checkpoints: the tensor roster of docs/kimi-k3-format.md §2 with seeded weights.

Shapes: `tiny` (every mechanism at toy width, for tests), `bench` (real-size
MXFP4 experts, 3 x 3072 x 3584, at reduced width, depth and expert count) and
`full-layer` (real widths, one dense and one MoE layer with all 896 experts).
Routed experts are random MXFP4 packs (uint8 codes, E8M0 scales near 1/sqrt(fan-in)).
"""

from __future__ import annotations

import copy
import functools
import math
from pathlib import Path
from typing import Any

import torch

from deltafind.importer.synthetic_families import Family, Spec, linear, norm

F32 = torch.float32
E2M1_RMS = math.sqrt(sum(v * v for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)) / 8)
NUM_RESERVED = 256
MERGES = 256


@functools.lru_cache(maxsize=1)
def _tokenizer_ranks() -> int:
    from deltafind.tokenizer.kimi import train_ranks

    return len(train_ranks(MERGES))


def write_k3_tokenizer(dest: Path, d: dict[str, Any]) -> list[str]:
    from deltafind.tokenizer.kimi import write_k3_tokenizer as write

    return write(dest, num_merges=MERGES)


def _scale_spec(rows: int, cols: int) -> Spec:
    center = round(
        127 + math.log2(1.0 / (math.sqrt(cols) * E2M1_RMS))
    )  # so W has std ~ 1/sqrt(fan-in)
    return Spec((rows, cols // 32), torch.uint8, "bytes", lo=center - 1, hi=center + 1)


def _mxfp4(p: str, rows: int, cols: int) -> dict[str, Spec]:
    return {
        f"{p}.weight_packed": Spec((rows, cols // 2), torch.uint8, "bytes", lo=0, hi=255),
        f"{p}.weight_scale": _scale_spec(rows, cols),
    }


def _kda(p: str, d: dict[str, Any]) -> dict[str, Spec]:
    h, k = d["hidden"], d["kda_dim"]
    dd = d["kda_heads"] * k
    return {
        **{f"{p}{n}_proj.weight": linear(dd, h) for n in ("q", "k", "v")},
        **{f"{p}{n}_conv1d.weight": Spec((dd, 1, 4), F32, "normal", 0.5) for n in ("q", "k", "v")},
        f"{p}g_proj.weight": linear(dd, h),
        f"{p}f_a_proj.weight": linear(k, h),
        f"{p}f_b_proj.weight": linear(dd, k),
        f"{p}b_proj.weight": linear(d["kda_heads"], h),
        f"{p}o_proj.weight": linear(h, dd),
        f"{p}A_log": Spec((k,), F32, "log_uniform", lo=1.0, hi=16.0),
        f"{p}dt_bias": Spec((dd,), F32, "uniform", lo=-3.0, hi=1.0),
        f"{p}o_norm.weight": norm(k, F32),
    }


def _mla(p: str, d: dict[str, Any]) -> dict[str, Spec]:
    h, nh = d["hidden"], d["heads"]
    return {
        f"{p}q_a_proj.weight": linear(d["q_lora"], h),
        f"{p}q_a_layernorm.weight": norm(d["q_lora"]),
        f"{p}q_b_proj.weight": linear(nh * (d["nope"] + d["rope"]), d["q_lora"]),
        f"{p}kv_a_proj_with_mqa.weight": linear(d["kv_lora"] + d["rope"], h),
        f"{p}kv_a_layernorm.weight": norm(d["kv_lora"]),
        f"{p}kv_b_proj.weight": linear(nh * (d["nope"] + d["v"]), d["kv_lora"]),
        f"{p}g_proj.weight": linear(nh * d["v"], h),
        f"{p}o_proj.weight": linear(h, nh * d["v"]),
    }


def _moe(p: str, d: dict[str, Any]) -> dict[str, Spec]:
    h, lat, inter = d["hidden"], d["latent"], d["moe_inter"]
    out = {
        f"{p}gate.weight": linear(d["experts"], h),
        f"{p}gate.e_score_correction_bias": Spec((d["experts"],), F32, "normal", 0.05),
        f"{p}routed_expert_down_proj.weight": linear(lat, h),
        f"{p}routed_expert_norm.weight": norm(lat),
        f"{p}routed_expert_up_proj.weight": linear(h, lat, gain=0.5),
        f"{p}shared_experts.gate_proj.weight": linear(2 * inter, h),
        f"{p}shared_experts.up_proj.weight": linear(2 * inter, h),
        f"{p}shared_experts.down_proj.weight": linear(h, 2 * inter, gain=0.5),
    }
    for e in range(d["experts"]):
        q = f"{p}experts.{e}."
        out.update(
            {
                **_mxfp4(q + "w1", inter, lat),
                **_mxfp4(q + "w2", lat, inter),
                **_mxfp4(q + "w3", inter, lat),
            }
        )
    return out


# The released compressed-tensors block (what config.json's quantization_config says for K3's experts).
QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "mxfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "format": "mxfp4-pack-quantized",
            "weights": {
                "num_bits": 4,
                "type": "float",
                "group_size": 32,
                "strategy": "group",
                "symmetric": True,
                "dynamic": False,
                "observer": "minmax",
                "scale_dtype": "torch.uint8",
            },
        }
    },
}


def text_config(d: dict[str, Any]) -> dict[str, Any]:
    n, vocab = d["layers"], _tokenizer_ranks() + NUM_RESERVED
    bos, eos, pad = vocab - NUM_RESERVED, vocab - NUM_RESERVED + 2, vocab - 1
    mla = sorted(d["mla"])
    return {
        "model_type": "kimi_linear",
        "dtype": "bfloat16",
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "hidden_size": d["hidden"],
        "intermediate_size": d["inter"],
        "moe_intermediate_size": d["moe_inter"],
        "routed_expert_hidden_size": d["latent"],
        "num_hidden_layers": n,
        "num_experts": d["experts"],
        "num_experts_per_token": 16,
        "num_shared_experts": 2,
        "num_attention_heads": d["heads"],
        "num_key_value_heads": d["heads"],
        "vocab_size": vocab,
        "max_position_embeddings": 1048576,
        "attn_res_block_size": d["block"],
        "q_lora_rank": d["q_lora"],
        "kv_lora_rank": d["kv_lora"],
        "qk_nope_head_dim": d["nope"],
        "qk_rope_head_dim": d["rope"],
        "v_head_dim": d["v"],
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "num_expert_group": 1,
        "topk_group": 1,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "moe_router_activation_func": "sigmoid",
        "topk_method": "noaux_tc",
        "use_grouped_topk": True,
        "moe_renormalize": True,
        "routed_scaling_factor": 1.0,
        "latent_moe_use_norm": True,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "use_cache": True,
        "num_nextn_predict_layers": 0,
        "linear_attn_config": {
            "head_dim": d["kda_dim"],
            "num_heads": d["kda_heads"],
            "short_conv_kernel_size": 4,
            "use_full_rank_gate": True,
            "gate_lower_bound": -5.0,
            "kda_layers": [i for i in range(1, n + 1) if i not in mla],
            "full_attn_layers": mla,
        },
        "quantization_config": copy.deepcopy(QUANTIZATION_CONFIG),
    }


def k3_roster(d: dict[str, Any], vocab: int) -> dict[str, Spec]:
    """Every tensor of K3's text model as released (docs/kimi-k3-format.md §2): name -> shape, dtype.
    `d` holds the sizes (SHAPES' keys; `dense`: leading dense layers, 1 unless given). The GGUF import
    (importer/gguf_k3.py) names, shapes and types its tensors from this roster too."""
    h = d["hidden"]
    specs = {
        "model.embed_tokens.weight": Spec((vocab, h), std=1.0),
        "model.norm.weight": norm(h),
        "model.output_attn_res_norm.weight": norm(h),
        "model.output_attn_res_proj.weight": linear(1, h),
        "lm_head.weight": linear(vocab, h),
    }
    for i in range(d["layers"]):
        p = f"model.layers.{i}."
        for side in ("self_attention", "mlp"):
            specs[f"{p}{side}_res_norm.weight"] = norm(h)
            specs[f"{p}{side}_res_proj.weight"] = linear(1, h)
        specs[p + "input_layernorm.weight"] = norm(h)
        specs[p + "post_attention_layernorm.weight"] = norm(h)
        specs.update((_mla if (i + 1) in d["mla"] else _kda)(p + "self_attn.", d))
        if i < d.get("dense", 1):
            specs.update(
                {f"{p}mlp.{n}.weight": linear(d["inter"], h) for n in ("gate_proj", "up_proj")}
            )
            specs[p + "mlp.down_proj.weight"] = linear(h, d["inter"], gain=0.5)
        else:
            specs.update(_moe(p + "block_sparse_moe.", d))
    return specs


def build_k3(d: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Spec]]:
    text = text_config(d)
    specs = k3_roster(d, text["vocab_size"])
    root = {
        "model_type": "kimi_k3",
        "architectures": ["KimiK3ForConditionalGeneration"],
        "dtype": "bfloat16",
        "tie_word_embeddings": False,
        "bos_token_id": text["bos_token_id"],
        "eos_token_id": text["eos_token_id"],
        "pad_token_id": text["pad_token_id"],
        "text_config": text,
    }
    return root, specs


REAL = {
    "hidden": 7168,
    "inter": 33792,
    "moe_inter": 3072,
    "latent": 3584,
    "heads": 96,
    "q_lora": 1536,
    "kv_lora": 512,
    "nope": 128,
    "rope": 64,
    "v": 128,
    "kda_heads": 96,
    "kda_dim": 128,
    "block": 12,
}
SHAPES = {
    # 7 layers: MLA at 4 and 7 (one-based, the last one too), AttnRes blocks of 3 so the tail mixes 3 anchors.
    "tiny": {
        "hidden": 64,
        "inter": 96,
        "moe_inter": 32,
        "latent": 64,
        "heads": 2,
        "q_lora": 32,
        "kv_lora": 16,
        "nope": 16,
        "rope": 8,
        "v": 16,
        "kda_heads": 2,
        "kda_dim": 16,
        "block": 3,
        "layers": 7,
        "mla": [4, 7],
        "experts": 24,
    },
    "bench": {
        **REAL,
        "hidden": 1024,
        "inter": 2048,
        "heads": 8,
        "q_lora": 256,
        "kv_lora": 128,
        "kda_heads": 8,
        "block": 2,
        "layers": 4,
        "mla": [4],
        "experts": 64,
    },
    "full-layer": {**REAL, "layers": 2, "mla": [2], "experts": 896},
}
FAMILIES = {"kimi_k3": Family(SHAPES, build_k3, write_k3_tokenizer)}
