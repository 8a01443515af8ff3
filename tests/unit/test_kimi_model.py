"""The whole kimi_k3 model on a `tiny` synthetic store: decode vs recompute, streamed vs
resident experts, a K3-layout HF folder vs the synthetic store it was written from,
the quality guard, and `deltafind setup --synthetic` + `deltafind run` as a user runs them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deltafind import Model
from deltafind.errors import UnsupportedModelError
from deltafind.importer.setup import setup_store
from deltafind.importer.synthetic import open_synthetic, write_hf_folder
from deltafind.importer.synthetic_k3 import REAL, text_config
from deltafind.models import kimi_k3
from deltafind.models.kimi_k3_config import ModelArgs, QualityRefused
from deltafind.models.ops.batch import SequenceCache, forward_step
from deltafind.models.ops.kda import safe_gate
from deltafind.models.ops.situ import situ
from deltafind.models.ops.stored import adopt_stored
from deltafind.provider import DictExpertProvider
from deltafind.store.buffers import record_tensors
from deltafind.store.manifest import Manifest
from deltafind.store.reader import PackReader
from tests.conftest import deltafind_cmd

PROMPT = [5, 77, 300, 12, 480, 9, 101, 33, 250, 7, 64, 2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("k3")
    store = root / "store"
    setup_store(
        open_synthetic("kimi_k3", "tiny", seed=3),
        store,
        [root / "d0", root / "d1"],
        dense_slices=2,
        progress=False,
        names=kimi_k3.WEIGHTS,
    )
    return root, store


@pytest.fixture(scope="module")
def model(tiny: tuple[Path, Path]):
    m = Model.open(
        tiny[1], expert_bytes=0, prefetch=False
    )  # every expert read from the drives, every time
    yield m
    m.close()


def _steps(net: torch.nn.Module, ids: list[int], splits: list[int]) -> torch.Tensor:
    cache, out, start = SequenceCache(net.num_layers), [], 0
    with torch.inference_mode():
        for n in splits:
            out.append(forward_step(net, cache, ids[start : start + n], all_logits=True))
            start += n
    return torch.cat(out)


def test_incremental_decode_equals_full_recompute(model: Model) -> None:
    full = model.forward_logits(PROMPT)
    assert full.shape == (len(PROMPT), model.net.args.vocab_size) and torch.isfinite(full).all()
    inc = _steps(model.net, PROMPT, [5, 1, 1, 3, 1, 1])
    torch.testing.assert_close(inc, full, atol=2e-5, rtol=0)


def test_streamed_equals_resident(model: Model, tiny: tuple[Path, Path]) -> None:
    store = tiny[1]
    manifest = Manifest.load(store)
    reader = PackReader(manifest, store)
    # Resident: every record in RAM, MXFP4 bytes as uint8 (the store path widens nothing it need not).
    experts = {
        r.key: {n: t.clone() for n, t in record_tensors(r, reader.read(r)).items()}
        for r in manifest.experts
    }
    reader.close()
    args = ModelArgs.from_config(manifest.model_config)
    with torch.device("meta"):
        resident = kimi_k3.Model(args, DictExpertProvider(experts))
    resident.load_state_dict(model.net.state_dict(), assign=True)
    adopt_stored(
        resident, torch.float32
    )  # as Model.open wires it: bf16 weights computed on as stored
    resident.eval()
    streamed = model.forward_logits(PROMPT)
    assert torch.equal(_steps(resident, PROMPT, [len(PROMPT)]), streamed)
    assert model.experts.stats.read > 0 and model.experts.stats.cache_hits == 0


def test_hf_folder_imports_to_the_same_logits(model: Model, tiny: tuple[Path, Path]) -> None:
    root = tiny[0]
    source = open_synthetic("kimi_k3", "tiny", seed=3)
    vision = {
        "vision_tower.patch_embed.weight": torch.randn(4, 4).to(torch.bfloat16),
        "mm_projector.proj.weight": torch.randn(2, 4),
    }
    folder = write_hf_folder(
        source, root / "hf", num_shards=3, prefix="language_model.", extra=vision
    )
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert all(
        n.startswith(("language_model.", "vision_tower.", "mm_projector."))
        for n in index["weight_map"]
    )
    assert (
        len(set(index["weight_map"].values())) == 3
        and json.loads((folder / "config.json").read_text())["text_config"]
    )
    store = root / "from_hf"
    manifest = setup_store(
        folder, store, [root / "h0"], dense_slices=2, progress=False, names=kimi_k3.WEIGHTS
    )
    synthetic = Manifest.load(tiny[1])
    # Experts went in byte for byte: same record payloads (sha256), in the release's tensor order.
    assert {r.key: r.sha256 for r in manifest.experts} == {
        r.key: r.sha256 for r in synthetic.experts
    }
    moe = next(r for r in manifest.experts if r.layer == 1)
    assert tuple(t.name for t in moe.tensors) == kimi_k3.MXFP4_RECORD and {
        t.dtype for t in moe.tensors
    } == {"uint8"}
    assert moe.length == sum(t.nbytes for t in moe.tensors)  # no padding between the six tensors
    imported = Model.open(store, expert_bytes=0, prefetch=False)
    try:
        assert torch.equal(imported.forward_logits(PROMPT), model.forward_logits(PROMPT))
        assert type(imported.tokenizer).__name__ == "KimiTokenizer"
    finally:
        imported.close()


def _tiny_config() -> dict:
    return open_synthetic("kimi_k3", "tiny").config


@pytest.mark.parametrize(
    "change,reason",
    [
        ({"num_experts_per_token": 8}, "routes 16"),
        ({"num_shared_experts": 0}, "shared experts"),
        ({"quantization_config": None}, "MXFP4"),
        ({"quantization_config": {"quant_method": "gptq", "bits": 2}}, "lossy"),
    ],
)
def test_quality_guard_refuses_with_the_reason(change: dict, reason: str) -> None:
    cfg = _tiny_config()
    cfg["text_config"].update(change)
    with pytest.raises(QualityRefused, match=reason):
        ModelArgs.from_config(cfg)


def test_quality_guard_refuses_flags_and_fp16_loads(tiny: tuple[Path, Path]) -> None:
    cfg = _tiny_config()
    with pytest.raises(QualityRefused, match="not a tuning knob"):
        ModelArgs.from_config(cfg, num_experts_per_token=15)
    weights = cfg["text_config"]["quantization_config"]["config_groups"]["group_0"]["weights"]
    weights["group_size"] = 128
    with pytest.raises(QualityRefused, match="group_size=128"):
        ModelArgs.from_config(cfg)
    with pytest.raises(QualityRefused, match="float16"):
        Model.open(tiny[1], dtype="float16")


def test_contract_and_real_schedule() -> None:
    cfg = _tiny_config()
    cfg["text_config"]["hidden_act"] = "silu"
    with pytest.raises(UnsupportedModelError, match="situ"):
        ModelArgs.from_config(cfg)
    real = text_config(
        {
            **REAL,
            "layers": 93,
            "experts": 896,
            "mla": [i for i in range(1, 94) if i % 4 == 0 or i == 93],
        }
    )
    args = ModelArgs.from_config({"model_type": "kimi_k3", "text_config": real})
    assert sorted(args.mla_layers) == [*range(3, 92, 4), 92] and len(args.mla_layers) == 24
    assert not args.is_moe_layer(0) and sum(args.is_moe_layer(i) for i in range(93)) == 92


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_kda_a_form_neg_exp_gives_the_log_forms_gate(per_channel: bool, lower_bound) -> None:
    """llama.cpp's ssm_a holds A = -exp(A_log): read as the rate -A it gives the gate A_log gives."""
    gen = torch.Generator().manual_seed(0)
    t, nh, k = 5, 3, 8
    f, dt = torch.randn(t, nh, k, generator=gen), torch.randn(nh * k, generator=gen)
    a_log = torch.rand(k if per_channel else nh, generator=gen) * 3 - 1  # rates e^-1..e^2
    want = safe_gate(f, a_log, dt, lower_bound, per_channel)
    got = safe_gate(f, -torch.exp(a_log), dt, lower_bound, per_channel, a_form="neg_exp")
    assert torch.equal(got, want)
    assert not torch.equal(safe_gate(f, -torch.exp(a_log), dt, lower_bound, per_channel), want)
    cfg = _tiny_config()
    cfg["text_config"]["kda_a_form"] = "exp"
    with pytest.raises(UnsupportedModelError, match=r"kda_a_form='exp'.*neg_exp"):
        ModelArgs.from_config(cfg)


def test_situ_soft_caps() -> None:
    g, u = torch.tensor([-50.0, 0.0, 1.0, 50.0]), torch.tensor([1000.0, 2.0, -3.0, -1000.0])
    want = (4 * torch.tanh(g / 4) * torch.sigmoid(g)) * (25 * torch.tanh(u / 25))
    assert torch.equal(situ(g, u), want)
    assert situ(torch.tensor(1e4), torch.tensor(1e4)).item() == pytest.approx(100.0)  # 4 * 25


def test_cli_setup_synthetic_then_run(tmp_path: Path) -> None:
    store = tmp_path / "k3"
    proc = deltafind_cmd(
        "setup", "--synthetic", "kimi_k3", "--shape", "tiny", "--store", str(store), "--quiet"
    )
    assert proc.returncode == 0 and "kimi_k3" in proc.stdout, proc.stderr
    proc = deltafind_cmd(
        "run",
        "--store",
        str(store),
        "--prompt",
        "Hello",
        "--max-new",
        "4",
        "--expert-bytes",
        "0",
        "--stats",
    )
    assert proc.returncode == 0, proc.stderr
    assert "generated 4 tok" in proc.stderr and "read" in proc.stderr


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_synthetic_stores_of_other_families_run(family: str, tmp_path: Path) -> None:
    source = open_synthetic(family, "tiny", seed=1)
    setup_store(source, tmp_path / "s", dense_slices=2, progress=False)
    again = open_synthetic(family, "tiny", seed=1)
    name = next(iter(source.tensors))
    assert torch.equal(source.load(name), again.load(name))  # seeded per tensor name
    m = Model.open(tmp_path / "s")
    try:
        assert len(m.generate(m.tokenizer.encode("Hello"), max_new_tokens=3)) == 3
    finally:
        m.close()
