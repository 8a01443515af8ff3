"""GGUF import (importer/gguf_source.py): split files found and checked from any shard, every architecture
named through gguf-py's tables, unsupported block types refused, and a partial store never reported ready.

The GGUFs are written by gguf-py in llama.cpp's layout (tests/gguf_models.py); a split one is cut by
GGUFWriter's `split_max_tensors`, which names and marks its shards as gguf-split does.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from deltafind.errors import StoreError, UnsupportedModelError
from deltafind.importer.checkpoint import open_source
from deltafind.importer.gguf_arch import llama3_rope
from deltafind.importer.gguf_source import GGUFOptions
from deltafind.importer.setup import setup_store
from deltafind.store.manifest import MANIFEST_NAME
from tests.gguf_models import MAKERS, Builder, make_llama


def _manifest_view(store: Path) -> tuple[dict, list]:
    m = json.loads((store / MANIFEST_NAME).read_text())
    return m["model_config"], [(r["layer"], r["expert"], r["sha256"]) for r in m["experts"]]


@pytest.fixture(scope="module")
def llama_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    root = tmp_path_factory.mktemp("gguf")
    whole = (
        make_llama(1).write(root / "whole" / "m.gguf") if (root / "whole").mkdir() is None else None
    )
    (root / "split").mkdir()
    shards = make_llama(1).write(root / "split" / "m.gguf", shards=2)
    return whole[0], shards


def test_split_llama_from_either_shard_gives_the_whole_files_store(
    llama_files, tmp_path: Path
) -> None:
    whole, shards = llama_files
    assert [p.name for p in shards] == ["m-00001-of-00002.gguf", "m-00002-of-00002.gguf"]
    setup_store(whole, tmp_path / "whole", progress=False)
    want = _manifest_view(tmp_path / "whole")
    spine = (tmp_path / "whole" / "spine.safetensors").read_bytes()
    for i, shard in enumerate(shards):
        setup_store(shard, tmp_path / f"s{i}", progress=False)
        assert _manifest_view(tmp_path / f"s{i}") == want
        assert (tmp_path / f"s{i}" / "spine.safetensors").read_bytes() == spine


def test_setup_parses_each_shard_once(
    llama_files, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tokenizer is written from the reader setup already holds: gguf-py parses a real vocabulary
    (150k tokens and their merges) in seconds, so a second parse was most of a small import's time."""
    import gguf

    parsed: list[str] = []
    init = gguf.GGUFReader.__init__

    def counting(self: Any, path: Any, *args: Any, **kwargs: Any) -> None:
        parsed.append(Path(path).name)
        init(self, path, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFReader, "__init__", counting)
    _, shards = llama_files
    setup_store(shards[0], tmp_path / "s", progress=False)
    assert sorted(parsed) == sorted(p.name for p in shards)


def test_a_missing_shard_is_refused_naming_it(llama_files, tmp_path: Path) -> None:
    _, shards = llama_files
    (tmp_path / "only").mkdir()
    first = Path(shutil.copy(shards[0], tmp_path / "only"))
    with pytest.raises(StoreError, match=r"m-00002-of-00002\.gguf"):
        setup_store(first, tmp_path / "s", progress=False)
    assert not (tmp_path / "s" / MANIFEST_NAME).exists()


def test_a_store_missing_layers_is_not_reported_ready(tmp_path: Path) -> None:
    b = make_llama(1)
    b.tensors = [t for t in b.tensors if not t[0].startswith("blk.2.")]  # block_count still says 3
    with pytest.raises(StoreError, match=r"no tensors for layers \[2\] of the 3"):
        setup_store(b.write(tmp_path / "m.gguf")[0], tmp_path / "s", progress=False)
    assert not (tmp_path / "s" / MANIFEST_NAME).exists()


def test_a_shard_of_another_split_is_refused(llama_files, tmp_path: Path) -> None:
    _, shards = llama_files
    other = make_llama(2)
    other.tensors = other.tensors[:-1]  # another split: another tensor count
    other_shards = other.write(tmp_path / "m.gguf", shards=2)
    shutil.copy(shards[0], other_shards[0])
    with pytest.raises(StoreError, match=r"split\.tensors\.count"):
        open_source(other_shards[1])


def test_a_renamed_shard_is_refused(llama_files, tmp_path: Path) -> None:
    renamed = Path(shutil.copy(llama_files[1][0], tmp_path / "model.gguf"))
    with pytest.raises(StoreError, match="gguf-split's file names"):
        open_source(renamed)


@pytest.mark.parametrize("arch", sorted(MAKERS))
def test_every_architecture_imports_and_opens(arch: str, tmp_path: Path) -> None:
    from deltafind import Model

    files = MAKERS[arch](3).write(tmp_path / f"{arch}.gguf", shards=2)
    setup_store(
        files[0], tmp_path / "store", progress=False, names=_names(open_source(files[0]).config)
    )
    model = Model.open(tmp_path / "store")
    try:
        logits = model.forward_logits([1, 2, 3, 4])
    finally:
        model.close()
    assert torch.isfinite(logits).all()


def _names(config: dict):
    from deltafind.models.registry import family_module

    family = family_module(config["model_type"])
    return family.weight_names(family.ModelArgs.from_config(config))


def test_merged_experts_become_per_expert_blocks(tmp_path: Path) -> None:
    import gguf

    b = MAKERS["qwen3moe"](4)
    path = b.write(tmp_path / "m.gguf")[0]
    src = open_source(path)
    merged = next(
        t for t in gguf.GGUFReader(str(path)).tensors if t.name == "blk.1.ffn_down_exps.weight"
    )
    for e in (0, 5):
        got = src.load(f"model.layers.1.mlp.experts.{e}.down_proj.weight")
        assert src.tensors[f"model.layers.1.mlp.experts.{e}.down_proj.weight"].quant == "Q6_K/256"
        assert np.array_equal(got.numpy(), np.asarray(merged.data[e]))


@pytest.mark.parametrize("halves", ["Q8_0", "BF16"])
def test_mla_kv_b_is_rebuilt_from_its_split_halves(halves: str, tmp_path: Path) -> None:
    """llama.cpp's attn_k_b/attn_v_b halves, as blocks or as BF16 (a BF16 conversion's), become the
    kv_b_proj their values were split from, exactly."""
    import gguf

    b = MAKERS["deepseek2"](5)
    if halves == "BF16":  # the same values, stored as BF16 bits
        for i, (name, arr, raw) in enumerate(b.tensors):
            if name.startswith("blk.2.attn_") and name.endswith(("k_b.weight", "v_b.weight")):
                f = torch.from_numpy(gguf.quants.dequantize(arr, raw)).to(torch.bfloat16)
                bits = f.view(torch.int16).numpy().view(np.uint8)
                b.tensors[i] = (
                    name,
                    bits.reshape(*f.shape[:-1], -1),
                    gguf.GGMLQuantizationType.BF16,
                )
    path = b.write(tmp_path / "m.gguf")[0]
    src = open_source(path)
    by = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    k_b, v_b = (
        gguf.quants.dequantize(by[n].data, by[n].tensor_type).astype(np.float32)
        for n in ("blk.2.attn_k_b.weight", "blk.2.attn_v_b.weight")
    )  # [heads, lora, nope], [heads, v, lora]
    kv_b = src.load("model.layers.2.self_attn.kv_b_proj.weight").reshape(
        k_b.shape[0], -1, k_b.shape[1]
    )  # [heads, nope+v, lora]
    assert np.array_equal(kv_b[:, : k_b.shape[2]].numpy(), k_b.transpose(0, 2, 1))
    assert np.array_equal(kv_b[:, k_b.shape[2] :].numpy(), v_b)
    assert "model.layers.2.mlp.gate.e_score_correction_bias" in src.tensors


def test_unsupported_architecture_is_refused_naming_the_supported_ones(tmp_path: Path) -> None:
    b = Builder("gemma3", 0)
    b.norm("output_norm.weight", 256)
    with pytest.raises(
        UnsupportedModelError,
        match=r"'gemma3' is not supported \(supported: deepseek2, kimi-k3, llama, qwen2, qwen3, qwen3moe\)$",
    ):
        open_source(b.write(tmp_path / "g.gguf")[0])


def test_a_type_without_kernel_is_refused_unless_widened(tmp_path: Path) -> None:
    b = make_llama(6)
    b.tensors = [(n, a, r) for n, a, r in b.tensors if n != "blk.1.ffn_up.weight"]
    b.weight("blk.1.ffn_up.weight", (512, 256), "TQ2_0")
    path = b.write(tmp_path / "m.gguf")[0]
    with pytest.raises(
        UnsupportedModelError,
        match=r"blk\.1\.ffn_up\.weight is TQ2_0.*--widen-unsupported.*524,288 bytes as float32 instead of 33,792",
    ):
        open_source(path)
    wide = open_source(path, GGUFOptions(widen=True))
    assert wide.tensors["model.layers.1.mlp.up_proj.weight"].dtype == torch.float32
    assert wide.load("model.layers.1.mlp.up_proj.weight").shape == (512, 256)


def test_llama3_rope_freqs_read_back_as_transformers_scaling() -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = llama3_rope(
        _converter_rope_freqs(8.0, 1.0, 4.0, 8192, 500000.0, 128), 500000.0, 128, 8192
    )
    cfg = LlamaConfig(
        head_dim=128,
        hidden_size=4096,
        num_attention_heads=32,
        rope_theta=500000.0,
        rope_scaling=params,
    )
    inv, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    base = 1.0 / 500000.0 ** (np.arange(0, 128, 2) / 128)
    assert np.allclose(
        inv.numpy(), base / _converter_rope_freqs(8.0, 1.0, 4.0, 8192, 500000.0, 128), rtol=1e-5
    )


def _converter_rope_freqs(
    factor: float, low: float, high: float, old: int, theta: float, dim: int
) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf (LlamaModel.generate_extra_tensors) for rope_type llama3."""
    freqs = 1.0 / theta ** (np.arange(0, dim, 2) / dim)
    out = []
    for f in freqs:
        wavelen = 2 * np.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out)
