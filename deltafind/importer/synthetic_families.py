"""Synthetic layouts of the Llama-style families (llama, qwen3_moe) under HF tensor names, and the
building blocks every synthetic layout uses (how to draw one tensor, a family's shapes).

Each shape gives an HF config.json and the tensor roster transformers would
save; tokenizers are a byte-level BPE without merges plus an EOS and a chat
template, enough to run the model. Add a family to `FAMILIES`.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

BYTE_VOCAB = 256


@dataclass(frozen=True)
class Spec:
    """How to draw one tensor: `kind` in normal (std), ones (1 + std*noise), uniform (lo, hi),
    log_uniform (log of U(lo, hi)), bytes (uniform uint8 in [lo, hi])."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.bfloat16
    kind: str = "normal"
    std: float = 0.0
    lo: float = 0.0
    hi: float = 1.0


def linear(out: int, inp: int, dtype: torch.dtype = torch.bfloat16, gain: float = 1.0) -> Spec:
    return Spec((out, inp), dtype, "normal", gain / math.sqrt(inp))


def norm(dim: int, dtype: torch.dtype = torch.bfloat16) -> Spec:
    return Spec((dim,), dtype, "ones", 0.1)


@dataclass
class Family:
    shapes: dict[str, dict[str, Any]]
    build: Callable[[dict[str, Any]], tuple[dict[str, Any], dict[str, Spec]]]
    write_tokenizer: Callable[[Path, dict[str, Any]], list[str]]


def draw(spec: Spec, seed: int | str) -> torch.Tensor:
    """A tensor as `spec` says, from `seed` (a string is hashed to one: the same string, the same tensor)."""
    if isinstance(seed, str):
        seed = int.from_bytes(hashlib.sha256(seed.encode()).digest()[:8], "little") & (2**63 - 1)
    g = torch.Generator().manual_seed(seed)
    if spec.kind == "bytes":
        return torch.randint(
            int(spec.lo), int(spec.hi) + 1, spec.shape, dtype=torch.uint8, generator=g
        )
    if spec.kind == "normal":
        t = torch.randn(spec.shape, generator=g) * spec.std
    elif spec.kind == "ones":
        t = 1.0 + torch.randn(spec.shape, generator=g) * spec.std
    elif spec.kind in ("uniform", "log_uniform"):
        t = torch.rand(spec.shape, generator=g) * (spec.hi - spec.lo) + spec.lo
        t = t.log() if spec.kind == "log_uniform" else t
    else:
        raise ValueError(f"unknown synthetic tensor kind {spec.kind!r}")
    return t.to(spec.dtype)


def write_byte_tokenizer(dest: Path, dims: dict[str, Any]) -> list[str]:
    """256 byte tokens + <|eos|>, <|user|>, <|assistant|> (ids 256..258), no merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from deltafind.tokenizer.bpe import BYTE_TO_UNICODE

    dest.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(vocab={BYTE_TO_UNICODE[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|eos|>", "<|user|>", "<|assistant|>"])
    tok.save(str(dest / "tokenizer.json"))
    template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|eos|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    (dest / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|eos|>", "chat_template": template, "add_bos_token": False})
    )
    return ["tokenizer.json", "tokenizer_config.json"]


def _attention(p: str, d: dict[str, Any], qk_norm: bool) -> dict[str, Spec]:
    h, hd = d["hidden"], d["head_dim"]
    out = {
        f"{p}self_attn.q_proj.weight": linear(d["heads"] * hd, h),
        f"{p}self_attn.k_proj.weight": linear(d["kv_heads"] * hd, h),
        f"{p}self_attn.v_proj.weight": linear(d["kv_heads"] * hd, h),
        f"{p}self_attn.o_proj.weight": linear(h, d["heads"] * hd),
        f"{p}input_layernorm.weight": norm(h),
        f"{p}post_attention_layernorm.weight": norm(h),
    }
    if qk_norm:
        out[f"{p}self_attn.q_norm.weight"] = norm(hd)
        out[f"{p}self_attn.k_norm.weight"] = norm(hd)
    return out


def _mlp(p: str, h: int, inter: int) -> dict[str, Spec]:
    return {
        f"{p}gate_proj.weight": linear(inter, h),
        f"{p}up_proj.weight": linear(inter, h),
        f"{p}down_proj.weight": linear(h, inter),
    }


def _config(model_type: str, arch: str, d: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "model_type": model_type,
        "architectures": [arch],
        "vocab_size": d["vocab"],
        "hidden_size": d["hidden"],
        "intermediate_size": d["inter"],
        "num_hidden_layers": d["layers"],
        "num_attention_heads": d["heads"],
        "num_key_value_heads": d["kv_heads"],
        "head_dim": d["head_dim"],
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "eos_token_id": BYTE_VOCAB,
        "bos_token_id": None,
        "torch_dtype": "bfloat16",
        **extra,
    }


def _globals(d: dict[str, Any]) -> dict[str, Spec]:
    return {
        "model.embed_tokens.weight": Spec((d["vocab"], d["hidden"]), std=1.0),
        "model.norm.weight": norm(d["hidden"]),
        "lm_head.weight": linear(d["vocab"], d["hidden"]),
    }


def build_llama(d: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Spec]]:
    specs = _globals(d)
    for i in range(d["layers"]):
        specs.update(_attention(f"model.layers.{i}.", d, qk_norm=False))
        specs.update(_mlp(f"model.layers.{i}.mlp.", d["hidden"], d["inter"]))
    return _config("llama", "LlamaForCausalLM", d), specs


def build_qwen3_moe(d: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Spec]]:
    specs = _globals(d)
    for i in range(d["layers"]):
        p = f"model.layers.{i}."
        specs.update(_attention(p, d, qk_norm=True))
        if i in d["dense_layers"]:
            specs.update(_mlp(p + "mlp.", d["hidden"], d["inter"]))
            continue
        specs[p + "mlp.gate.weight"] = linear(d["experts"], d["hidden"])
        for e in range(d["experts"]):
            specs.update(_mlp(f"{p}mlp.experts.{e}.", d["hidden"], d["moe_inter"]))
    cfg = _config(
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        d,
        moe_intermediate_size=d["moe_inter"],
        num_experts=d["experts"],
        num_experts_per_tok=d["top_k"],
        norm_topk_prob=True,
        mlp_only_layers=sorted(d["dense_layers"]),
    )
    return cfg, specs


_TINY = {
    "vocab": BYTE_VOCAB + 44,
    "hidden": 64,
    "inter": 96,
    "layers": 2,
    "heads": 4,
    "kv_heads": 2,
    "head_dim": 16,
}
FAMILIES = {
    "llama": Family({"tiny": _TINY}, build_llama, write_byte_tokenizer),
    "qwen3_moe": Family(
        {
            "tiny": {**_TINY, "experts": 8, "top_k": 2, "moe_inter": 32, "dense_layers": {0}},
            "bench": {
                **_TINY,
                "hidden": 2048,
                "heads": 16,
                "kv_heads": 4,
                "head_dim": 128,
                "layers": 4,
                "inter": 6144,
                "experts": 64,
                "top_k": 8,
                "moe_inter": 768,
                "dense_layers": set(),
            },
        },
        build_qwen3_moe,
        write_byte_tokenizer,
    ),
}
