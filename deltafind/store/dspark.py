"""DSpark, K3's block drafter, as a K3 store holds it: `<store>/draft/dspark/{config.json, model.safetensors}`.

The released format (docs/kimi-k3-drafting-io.md §7.1): every pinned config key, the sizes checked
against the K3 store it drafts for, the 67-tensor roster, and the loader the engine's DSpark source uses.
Writing a draft into a store is the importer's (`dspark_import.py`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from deltafind.errors import StoreError
from deltafind.store.manifest import Manifest

DRAFT_DIR = Path("draft") / "dspark"
CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"
SKIPPED = "embed_tokens.weight"  # a copy of K3's embedding; deltafind never loads it

# Keys that change the math or the format: every checkpoint must have exactly these.
CONTRACT: dict[str, Any] = {
    "architectures": ["K3DSparkModel"],
    "model_type": "k3_dspark",
    "mla_use_nope": False,
    "mla_use_output_gate": False,
    "markov_head_type": "vanilla",
    "enable_confidence_head": True,
    "confidence_head_with_markov": True,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "num_hidden_layers": 5,
    "num_target_layers": 5,
}
ROPE_CONTRACT: dict[str, Any] = {"rope_type": "yarn"}
ROPE_KEYS = (
    "factor",
    "original_max_position_embeddings",
    "rope_theta",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
)
# The released checkpoint's sizes (docs/kimi-k3-drafting-io.md §7.1): required when the target is the real K3.
REAL: dict[str, Any] = {
    "hidden_size": 7168,
    "intermediate_size": 14336,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": 163840,
    "draft_vocab_size": 163840,
    "rms_norm_eps": 1e-05,
    "max_position_embeddings": 1048576,
    "rope_theta": 50000.0,
    "target_hidden_size": 7168,
    "target_num_hidden_layers": 93,
    "target_layer_ids": [2, 23, 47, 71, 89],
    "mask_token_id": 163837,
    "bos_token_id": 163584,
    "eos_token_id": 163586,
    "pad_token_id": 163839,
    "markov_rank": 256,
    "_torchspec_version": "0.1.0",
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 32.0,
        "original_max_position_embeddings": 32768,
        "rope_theta": 50000.0,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
}
SIZE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "vocab_size",
    "draft_vocab_size",
    "target_hidden_size",
    "target_num_hidden_layers",
    "mask_token_id",
    "markov_rank",
    "max_position_embeddings",
)


def text_config(target: dict[str, Any]) -> dict[str, Any]:
    if target.get("model_type") != "kimi_k3" or not isinstance(target.get("text_config"), dict):
        raise StoreError(
            f"DSpark drafts only for Kimi K3; the store holds {target.get('model_type')!r}"
        )
    return target["text_config"]


def check_config(cfg: dict[str, Any], target: dict[str, Any], where: str = CONFIG_NAME) -> None:
    """Refuse a DSpark config that is not the released format or was made for another target.

    `target` is the K3 store's root config.json. Raises StoreError naming the key.
    """

    def bad(key: str, got: Any, want: str) -> StoreError:
        return StoreError(
            f"{where}: {key} is {got!r}, {want}; this is not a Kimi K3 DSpark checkpoint for this store"
        )

    for key, want in CONTRACT.items():
        if cfg.get(key) != want:
            raise bad(key, cfg.get(key, "missing"), f"must be {want!r}")
    for key in SIZE_KEYS:
        if not isinstance(cfg.get(key), int) or isinstance(cfg.get(key), bool) or cfg[key] <= 0:
            raise bad(key, cfg.get(key, "missing"), "must be a positive integer")
    if not isinstance(cfg.get("rms_norm_eps"), (int, float)) or not 0 < cfg["rms_norm_eps"] < 1:
        raise bad(
            "rms_norm_eps", cfg.get("rms_norm_eps", "missing"), "must be a small positive number"
        )
    rope = cfg.get("rope_parameters")
    if (
        not isinstance(rope, dict)
        or any(rope.get(k) != v for k, v in ROPE_CONTRACT.items())
        or any(k not in rope for k in ROPE_KEYS)
    ):
        raise bad("rope_parameters", rope, f"must be a yarn dict with {', '.join(ROPE_KEYS)}")
    text = text_config(target)
    h, n, vocab = text["hidden_size"], text["num_hidden_layers"], text["vocab_size"]
    for key, want in (
        ("hidden_size", h),
        ("target_hidden_size", h),
        ("vocab_size", vocab),
        ("draft_vocab_size", vocab),
        ("target_num_hidden_layers", n),
        ("num_key_value_heads", cfg["num_attention_heads"]),
    ):
        if cfg[key] != want:
            raise bad(key, cfg[key], f"the target needs {want}")
    ids = cfg.get("target_layer_ids")
    if (
        not isinstance(ids, list)
        or len(ids) != cfg["num_target_layers"]
        or not all(isinstance(i, int) and 0 <= i < n for i in ids)
    ):
        raise bad(
            "target_layer_ids",
            ids,
            f"must list {cfg['num_target_layers']} layers of the target's 0..{n - 1}",
        )
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if cfg.get(key) != text.get(key):
            raise bad(key, cfg.get(key, "missing"), f"the target has {text.get(key)}")
    if not 0 <= cfg["mask_token_id"] < vocab:
        raise bad(
            "mask_token_id", cfg["mask_token_id"], f"must be below the vocabulary size {vocab}"
        )
    # the real target: the released sizes only
    if h == REAL["hidden_size"] and n == REAL["target_num_hidden_layers"]:
        for key, want in REAL.items():
            if cfg.get(key) != want:
                raise bad(
                    key,
                    cfg.get(key, "missing"),
                    f"the released checkpoint (docs/kimi-k3-drafting-io.md §7.1) has {want!r}",
                )


def roster(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor DSpark loads (all BF16), name -> shape; `embed_tokens.weight` is not among them."""
    h, inter, nh, r = (
        cfg["hidden_size"],
        cfg["intermediate_size"],
        cfg["num_attention_heads"],
        cfg["markov_rank"],
    )
    qk, kvr, dr = (
        cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"],
        cfg["kv_lora_rank"],
        cfg["qk_rope_head_dim"],
    )
    out: dict[str, tuple[int, ...]] = {
        "context_proj.weight": (h, cfg["num_target_layers"] * cfg["target_hidden_size"]),
        "context_norm.weight": (h,),
        "final_norm.weight": (h,),
        "markov_head.markov_w1.weight": (cfg["vocab_size"], r),
        "markov_head.markov_w2.weight": (cfg["vocab_size"], r),
        "confidence_head.proj.weight": (1, h + r),
        "confidence_head.proj.bias": (1,),
    }
    for j in range(cfg["num_hidden_layers"]):
        p = f"layers.{j}."
        out.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
                p + "self_attn.q_a_proj.weight": (cfg["q_lora_rank"], h),
                p + "self_attn.q_a_layernorm.weight": (cfg["q_lora_rank"],),
                p + "self_attn.q_b_proj.weight": (nh * qk, cfg["q_lora_rank"]),
                p + "self_attn.kv_a_proj_with_mqa.weight": (kvr + dr, h),
                p + "self_attn.kv_a_layernorm.weight": (kvr,),
                p + "self_attn.kv_b_proj.weight": (
                    nh * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]),
                    kvr,
                ),
                p + "self_attn.o_proj.weight": (h, nh * cfg["v_head_dim"]),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
            }
        )
    return out


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise StoreError(
            f"{path} is missing; a DSpark folder holds config.json and model.safetensors"
        ) from None
    except (OSError, ValueError) as e:
        raise StoreError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise StoreError(f"{path}: expected a JSON object")
    return data


def target_config(store: Path) -> dict[str, Any]:
    config = Manifest.load(store).model_config
    text_config(config)
    return config


def load_dspark(store: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config, bf16 tensors) of the store's DSpark; a store without one raises StoreError saying how to add it."""
    from safetensors.torch import load_file

    store = Path(store).expanduser()
    folder = store / DRAFT_DIR
    if not (folder / CONFIG_NAME).is_file() or not (folder / WEIGHTS_NAME).is_file():
        raise StoreError(
            f"{store} has no DSpark draft: run `deltafind setup --dspark DIR --store {store}` "
            f"(or `--synthetic dspark` for a random one)"
        )
    cfg = read_json(folder / CONFIG_NAME)
    check_config(cfg, target_config(store), str(folder / CONFIG_NAME))
    tensors = load_file(str(folder / WEIGHTS_NAME))
    want = roster(cfg)
    if set(tensors) != set(want) or any(tuple(tensors[n].shape) != s for n, s in want.items()):
        raise StoreError(
            f"{folder / WEIGHTS_NAME} does not match its config.json; run `deltafind setup --dspark` again"
        )
    return cfg, tensors
