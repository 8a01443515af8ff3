"""Writes DSpark, K3's block drafter, into a K3 store (the format and its checks: store/dspark.py).

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
from deltafind.importer.sources import TensorInfo
from deltafind.importer.spine_writer import write_safetensors
from deltafind.importer.synthetic import Spec, draw, linear, norm
from deltafind.store.dspark import (
    CONFIG_NAME,
    CONTRACT,
    DRAFT_DIR,
    REAL,
    SKIPPED,
    WEIGHTS_NAME,
    check_config,
    read_json,
    roster,
    target_config,
    text_config,
)
from deltafind.store.manifest import fsync_dir


def _write(
    store: Path,
    cfg: dict[str, Any],
    tensors: dict[str, TensorInfo],
    load: Callable[[str], torch.Tensor],
) -> Path:
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
        fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def import_dspark(src: str | Path, store: str | Path) -> Path:
    """Check and copy a DSpark HF folder (config.json + model.safetensors) into the K3 store; returns the draft folder."""
    from safetensors import safe_open

    src, store = Path(src).expanduser(), Path(store).expanduser()
    cfg = read_json(src / CONFIG_NAME)
    check_config(cfg, target_config(store), str(src / CONFIG_NAME))
    want = roster(cfg)
    weights = src / WEIGHTS_NAME
    if not weights.is_file():
        raise StoreError(
            f"{weights} is missing; a DSpark folder holds config.json and model.safetensors"
        )
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
                    raise StoreError(
                        f"{weights}: {name} has shape {list(shape)}, expected [{cfg['vocab_size']}, {cfg['hidden_size']}]"
                    )
            elif name not in want:
                raise StoreError(
                    f"{weights}: unexpected tensor {name}; this is not a Kimi K3 DSpark checkpoint"
                )
        for name, shape in want.items():
            if name not in have:
                raise StoreError(f"{weights}: tensor {name} is missing; re-download the checkpoint")
            if have[name] != ("BF16", shape):
                raise StoreError(
                    f"{weights}: {name} is {have[name][0]} {list(have[name][1])}, expected BF16 {list(shape)}"
                )
        infos = {n: TensorInfo(torch.bfloat16, s) for n, s in want.items()}
        return _write(store, cfg, infos, f.get_tensor)


def _spread(num_layers: int, count: int) -> list[int]:
    """`count` target layers spread like K3's [2, 23, 47, 71, 89] over 93 (repeats only when too few layers)."""
    return [
        min(num_layers - 1, round(i * (num_layers - 1) / 92))
        for i in REAL["target_layer_ids"][:count]
    ]


def synthetic_config(target: dict[str, Any]) -> dict[str, Any]:
    """A DSpark config of the released format, sized to a (synthetic) K3 target."""
    t = text_config(target)
    h, n, vocab = t["hidden_size"], t["num_hidden_layers"], t["vocab_size"]
    cfg = {
        **copy.deepcopy(REAL),
        **copy.deepcopy(CONTRACT),
        "hidden_size": h,
        "intermediate_size": 2 * h,
        "target_hidden_size": h,
        "target_num_hidden_layers": n,
        "num_attention_heads": max(2, round(t["num_attention_heads"] * 2 / 3)),
        "q_lora_rank": t["q_lora_rank"],
        "kv_lora_rank": t["kv_lora_rank"],
        "qk_nope_head_dim": t["qk_nope_head_dim"],
        "qk_rope_head_dim": t["qk_rope_head_dim"],
        "v_head_dim": t["v_head_dim"],
        "vocab_size": vocab,
        "draft_vocab_size": vocab,
        "mask_token_id": vocab - 3,
        "bos_token_id": t["bos_token_id"],
        "eos_token_id": t["eos_token_id"],
        "pad_token_id": t["pad_token_id"],
        "markov_rank": min(256, max(8, h // 4)),
        "target_layer_ids": REAL["target_layer_ids"] if n == 93 else _spread(n, 5),
    }
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
            specs[name] = linear(
                *shape, gain=0.5 if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
            )
    return specs


def write_synthetic_dspark(store: str | Path, seed: int = 0) -> Path:
    """A seeded random DSpark for the K3 store at `store` (same seed, same weights)."""
    store = Path(store).expanduser()
    cfg = synthetic_config(target_config(store))
    specs = synthetic_specs(cfg)

    infos = {n: TensorInfo(s.dtype, s.shape) for n, s in specs.items()}
    return _write(store, cfg, infos, lambda name: draw(specs[name], f"dspark:{seed}:{name}"))
