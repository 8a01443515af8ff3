"""DSpark, K3's block drafter, inside a K3 store: `<store>/draft/dspark/{config.json, model.safetensors}`.

Imports the released HF folder (docs/kimi-k3-drafting-io.md §7.1) after checking every pinned config key
and the 67-tensor roster against the K3 store it drafts for, skipping the
checkpoint's redundant `embed_tokens` copy (DSpark uses K3's). Also writes a
seeded random DSpark sized to a synthetic target, for tests. Files go in a
temporary folder first and replace the old draft in one rename.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from deltafind.errors import StoreError
from deltafind.store.manifest import Manifest
from deltafind.store.sources import TensorInfo
from deltafind.store.spine_writer import write_safetensors
from deltafind.store.synthetic import Spec, draw, linear, norm

DRAFT_DIR = Path("draft") / "dspark"
CONFIG_NAME, WEIGHTS_NAME = "config.json", "model.safetensors"
SKIPPED = "embed_tokens.weight"  # a copy of K3's embedding; deltafind never loads it

# Keys that change the math or the format: every checkpoint must have exactly these.
CONTRACT: dict[str, Any] = {
    "architectures": ["K3DSparkModel"], "model_type": "k3_dspark", "mla_use_nope": False, "mla_use_output_gate": False,
    "markov_head_type": "vanilla", "enable_confidence_head": True, "confidence_head_with_markov": True,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "num_hidden_layers": 5, "num_target_layers": 5,
}
ROPE_CONTRACT: dict[str, Any] = {"rope_type": "yarn"}
ROPE_KEYS = ("factor", "original_max_position_embeddings", "rope_theta", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
# The released checkpoint's sizes (docs/kimi-k3-drafting-io.md §7.1): required when the target is the real K3.
REAL: dict[str, Any] = {
    "hidden_size": 7168, "intermediate_size": 14336, "num_attention_heads": 64, "num_key_value_heads": 64,
    "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "vocab_size": 163840, "draft_vocab_size": 163840, "rms_norm_eps": 1e-05, "max_position_embeddings": 1048576,
    "rope_theta": 50000.0, "target_hidden_size": 7168, "target_num_hidden_layers": 93,
    "target_layer_ids": [2, 23, 47, 71, 89], "mask_token_id": 163837, "bos_token_id": 163584, "eos_token_id": 163586,
    "pad_token_id": 163839, "markov_rank": 256, "_torchspec_version": "0.1.0",
    "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 32768, "rope_theta": 50000.0,
                        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
}
SIZE_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "q_lora_rank", "kv_lora_rank",
             "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "vocab_size", "draft_vocab_size", "target_hidden_size",
             "target_num_hidden_layers", "mask_token_id", "markov_rank", "max_position_embeddings")


def _text(target: dict[str, Any]) -> dict[str, Any]:
    if target.get("model_type") != "kimi_k3" or not isinstance(target.get("text_config"), dict):
        raise StoreError(f"DSpark drafts only for Kimi K3; the store holds {target.get('model_type')!r}")
    return target["text_config"]


def check_config(cfg: dict[str, Any], target: dict[str, Any], where: str = CONFIG_NAME) -> None:
    """Refuse a DSpark config that is not the released format or was made for another target.

    `target` is the K3 store's root config.json. Raises StoreError naming the key.
    """
    def bad(key: str, got: Any, want: str) -> StoreError:
        return StoreError(f"{where}: {key} is {got!r}, {want}; this is not a Kimi K3 DSpark checkpoint for this store")

    for key, want in CONTRACT.items():
        if cfg.get(key) != want:
            raise bad(key, cfg.get(key, "missing"), f"must be {want!r}")
    for key in SIZE_KEYS:
        if not isinstance(cfg.get(key), int) or isinstance(cfg.get(key), bool) or cfg[key] <= 0:
            raise bad(key, cfg.get(key, "missing"), "must be a positive integer")
    if not isinstance(cfg.get("rms_norm_eps"), (int, float)) or not 0 < cfg["rms_norm_eps"] < 1:
        raise bad("rms_norm_eps", cfg.get("rms_norm_eps", "missing"), "must be a small positive number")
    rope = cfg.get("rope_parameters")
    if not isinstance(rope, dict) or any(rope.get(k) != v for k, v in ROPE_CONTRACT.items()) or any(k not in rope for k in ROPE_KEYS):
        raise bad("rope_parameters", rope, f"must be a yarn dict with {', '.join(ROPE_KEYS)}")
    text = _text(target)
    h, n, vocab = text["hidden_size"], text["num_hidden_layers"], text["vocab_size"]
    for key, want in (("hidden_size", h), ("target_hidden_size", h), ("vocab_size", vocab), ("draft_vocab_size", vocab),
                      ("target_num_hidden_layers", n), ("num_key_value_heads", cfg["num_attention_heads"])):
        if cfg[key] != want:
            raise bad(key, cfg[key], f"the target needs {want}")
    ids = cfg.get("target_layer_ids")
    if not isinstance(ids, list) or len(ids) != cfg["num_target_layers"] or not all(isinstance(i, int) and 0 <= i < n for i in ids):
        raise bad("target_layer_ids", ids, f"must list {cfg['num_target_layers']} layers of the target's 0..{n - 1}")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if cfg.get(key) != text.get(key):
            raise bad(key, cfg.get(key, "missing"), f"the target has {text.get(key)}")
    if not 0 <= cfg["mask_token_id"] < vocab:
        raise bad("mask_token_id", cfg["mask_token_id"], f"must be below the vocabulary size {vocab}")
    if h == REAL["hidden_size"] and n == REAL["target_num_hidden_layers"]:  # the real target: the released sizes only
        for key, want in REAL.items():
            if cfg.get(key) != want:
                raise bad(key, cfg.get(key, "missing"), f"the released checkpoint (docs/kimi-k3-drafting-io.md §7.1) has {want!r}")


def roster(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor DSpark loads (all BF16), name -> shape; `embed_tokens.weight` is not among them."""
    h, inter, nh, r = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"], cfg["markov_rank"]
    qk, kvr, dr = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    out: dict[str, tuple[int, ...]] = {
        "context_proj.weight": (h, cfg["num_target_layers"] * cfg["target_hidden_size"]),
        "context_norm.weight": (h,), "final_norm.weight": (h,),
        "markov_head.markov_w1.weight": (cfg["vocab_size"], r), "markov_head.markov_w2.weight": (cfg["vocab_size"], r),
        "confidence_head.proj.weight": (1, h + r), "confidence_head.proj.bias": (1,),
    }
    for j in range(cfg["num_hidden_layers"]):
        p = f"layers.{j}."
        out.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_a_proj.weight": (cfg["q_lora_rank"], h), p + "self_attn.q_a_layernorm.weight": (cfg["q_lora_rank"],),
            p + "self_attn.q_b_proj.weight": (nh * qk, cfg["q_lora_rank"]),
            p + "self_attn.kv_a_proj_with_mqa.weight": (kvr + dr, h), p + "self_attn.kv_a_layernorm.weight": (kvr,),
            p + "self_attn.kv_b_proj.weight": (nh * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), kvr),
            p + "self_attn.o_proj.weight": (h, nh * cfg["v_head_dim"]),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h), p + "mlp.down_proj.weight": (h, inter),
        })
    return out


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise StoreError(f"{path} is missing; a DSpark folder holds config.json and model.safetensors") from None
    except (OSError, ValueError) as e:
        raise StoreError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise StoreError(f"{path}: expected a JSON object")
    return data


def _target_config(store: Path) -> dict[str, Any]:
    config = Manifest.load(store).model_config
    _text(config)
    return config


def _write(store: Path, cfg: dict[str, Any], tensors: dict[str, TensorInfo], load: Callable[[str], torch.Tensor]) -> Path:
    """Write the draft folder under a temporary name, then swap it in with renames."""
    parent = store / DRAFT_DIR.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".dspark-", dir=parent))
    final = store / DRAFT_DIR
    try:
        write_safetensors(tmp / WEIGHTS_NAME, tensors, load)
        with open(tmp / CONFIG_NAME, "w") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        old = parent / f".dspark-old-{os.getpid()}"
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
        fd = os.open(parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def import_dspark(src: str | Path, store: str | Path) -> Path:
    """Check and copy a DSpark HF folder (config.json + model.safetensors) into the K3 store; returns the draft folder."""
    from safetensors import safe_open

    src, store = Path(src).expanduser(), Path(store).expanduser()
    cfg = _read_json(src / CONFIG_NAME)
    check_config(cfg, _target_config(store), str(src / CONFIG_NAME))
    want = roster(cfg)
    weights = src / WEIGHTS_NAME
    if not weights.is_file():
        raise StoreError(f"{weights} is missing; a DSpark folder holds config.json and model.safetensors")
    try:
        handle = safe_open(str(weights), "pt", device="cpu")
    except Exception as e:  # safetensors raises its own error types
        raise StoreError(f"{weights}: not a safetensors file ({e})") from None
    with handle as f:
        have, names = {}, f.keys()  # safe_open is not iterable
        for name in names:
            sl = f.get_slice(name)
            have[name] = (sl.get_dtype(), tuple(sl.get_shape()))
        for name, (_, shape) in have.items():
            if name == SKIPPED:
                if shape != (cfg["vocab_size"], cfg["hidden_size"]):
                    raise StoreError(f"{weights}: {name} has shape {list(shape)}, expected [{cfg['vocab_size']}, {cfg['hidden_size']}]")
            elif name not in want:
                raise StoreError(f"{weights}: unexpected tensor {name}; this is not a Kimi K3 DSpark checkpoint")
        for name, shape in want.items():
            if name not in have:
                raise StoreError(f"{weights}: tensor {name} is missing; re-download the checkpoint")
            if have[name] != ("BF16", shape):
                raise StoreError(f"{weights}: {name} is {have[name][0]} {list(have[name][1])}, expected BF16 {list(shape)}")
        infos = {n: TensorInfo(torch.bfloat16, s) for n, s in want.items()}
        return _write(store, cfg, infos, f.get_tensor)


def _spread(num_layers: int, count: int) -> list[int]:
    """`count` target layers spread like K3's [2, 23, 47, 71, 89] over 93 (repeats only when too few layers)."""
    return [min(num_layers - 1, round(i * (num_layers - 1) / 92)) for i in REAL["target_layer_ids"][:count]]


def synthetic_config(target: dict[str, Any]) -> dict[str, Any]:
    """A DSpark config of the released format, sized to a (synthetic) K3 target."""
    t = _text(target)
    h, n, vocab = t["hidden_size"], t["num_hidden_layers"], t["vocab_size"]
    cfg = {**copy.deepcopy(REAL), **copy.deepcopy(CONTRACT), "hidden_size": h, "intermediate_size": 2 * h, "target_hidden_size": h, "target_num_hidden_layers": n,
           "num_attention_heads": max(2, round(t["num_attention_heads"] * 2 / 3)), "q_lora_rank": t["q_lora_rank"],
           "kv_lora_rank": t["kv_lora_rank"], "qk_nope_head_dim": t["qk_nope_head_dim"], "qk_rope_head_dim": t["qk_rope_head_dim"],
           "v_head_dim": t["v_head_dim"], "vocab_size": vocab, "draft_vocab_size": vocab, "mask_token_id": vocab - 3,
           "bos_token_id": t["bos_token_id"], "eos_token_id": t["eos_token_id"], "pad_token_id": t["pad_token_id"],
           "markov_rank": min(256, max(8, h // 4)), "target_layer_ids": REAL["target_layer_ids"] if n == 93 else _spread(n, 5)}
    cfg["num_key_value_heads"] = cfg["num_attention_heads"]
    return cfg


def synthetic_specs(cfg: dict[str, Any]) -> dict[str, Spec]:
    specs = {}
    for name, shape in roster(cfg).items():
        if len(shape) == 1 and name.endswith("norm.weight"):
            specs[name] = norm(shape[0])
        elif name.endswith("bias"):
            specs[name] = Spec(shape, torch.bfloat16, "normal", 0.1)
        elif name.startswith("markov_head."):
            specs[name] = linear(*shape, gain=4.0)  # a Markov bias of about the logits' size
        else:
            specs[name] = linear(*shape, gain=0.5 if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0)
    return specs


def write_synthetic_dspark(store: str | Path, seed: int = 0) -> Path:
    """A seeded random DSpark for the K3 store at `store` (same seed, same weights)."""
    store = Path(store).expanduser()
    cfg = synthetic_config(_target_config(store))
    specs = synthetic_specs(cfg)

    infos = {n: TensorInfo(s.dtype, s.shape) for n, s in specs.items()}
    return _write(store, cfg, infos, lambda name: draw(specs[name], f"dspark:{seed}:{name}"))


def load_dspark(store: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config, bf16 tensors) of the store's DSpark; a store without one raises StoreError saying how to add it."""
    from safetensors.torch import load_file

    store = Path(store).expanduser()
    folder = store / DRAFT_DIR
    if not (folder / CONFIG_NAME).is_file() or not (folder / WEIGHTS_NAME).is_file():
        raise StoreError(f"{store} has no DSpark draft: run `deltafind setup --dspark DIR --store {store}` "
                         f"(or `--synthetic dspark` for a random one)")
    cfg = _read_json(folder / CONFIG_NAME)
    check_config(cfg, _target_config(store), str(folder / CONFIG_NAME))
    tensors = load_file(str(folder / WEIGHTS_NAME))
    want = roster(cfg)
    if set(tensors) != set(want) or any(tuple(tensors[n].shape) != s for n, s in want.items()):
        raise StoreError(f"{folder / WEIGHTS_NAME} does not match its config.json; run `deltafind setup --dspark` again")
    return cfg, tensors
