"""A DeepSeek-V3 checkpoint that carries its multi-token-prediction layer imports, opens and
matches transformers.

DeepSeek ships the MTP module as `model.layers.{num_hidden_layers}.*`: a full MoE decoder
layer plus `enorm`, `hnorm`, `eh_proj` and `shared_head`. The family's weight names drop it
on import (logged); before, its experts became extra records and the store failed to open.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deltafind import Model
from deltafind.store.manifest import Manifest
from tests.conftest import deltafind_cmd, make_hf_checkpoint

transformers = pytest.importorskip("transformers")
LAYERS = 2


def add_mtp_layer(folder: Path) -> int:
    """Append layer `LAYERS` as DeepSeek-V3 ships it (a copy of the last layer plus the MTP parts)."""
    path = folder / "model.safetensors"
    weights = load_file(path)
    last, g = f"model.layers.{LAYERS - 1}.", torch.Generator().manual_seed(7)
    mtp = {
        f"model.layers.{LAYERS}." + k[len(last) :]: v.clone()
        for k, v in weights.items()
        if k.startswith(last)
    }
    h, vocab = weights["model.norm.weight"].shape[0], weights["model.embed_tokens.weight"].shape[0]
    for name, shape in {
        "enorm.weight": (h,),
        "hnorm.weight": (h,),
        "eh_proj.weight": (h, 2 * h),
        "shared_head.norm.weight": (h,),
        "shared_head.head.weight": (vocab, h),
    }.items():
        mtp[f"model.layers.{LAYERS}.{name}"] = torch.randn(shape, generator=g)
    assert any(
        ".mlp.experts." in k for k in mtp
    )  # routed experts too: the case that broke the import
    save_file({**weights, **mtp}, str(path), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return len(mtp)


def test_mtp_checkpoint_imports_opens_and_matches_transformers(tmp_path: Path) -> None:
    folder = make_hf_checkpoint("deepseek_v3", tmp_path / "hf", num_hidden_layers=LAYERS)
    added = add_mtp_layer(folder)
    config = json.loads((folder / "config.json").read_text())
    proc = deltafind_cmd(
        "setup",
        "--from",
        str(folder),
        "--store",
        str(tmp_path / "store"),
        "--dense-slices",
        "2",
        "--quiet",
    )
    assert proc.returncode == 0, proc.stderr
    assert "setup_skipped_tensors" in proc.stderr and f"count={added}" in proc.stderr, proc.stderr
    assert {r.layer for r in Manifest.load(tmp_path / "store").experts} == set(range(LAYERS))

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
    ids = torch.randint(0, config["vocab_size"], (12,), generator=torch.Generator().manual_seed(3))
    ours = Model.open(tmp_path / "store", prefetch=False)
    try:
        with torch.no_grad():
            torch.testing.assert_close(
                ours.forward_logits(ids.tolist()), hf(ids[None]).logits[0], atol=1e-4, rtol=0
            )
    finally:
        ours.close()
