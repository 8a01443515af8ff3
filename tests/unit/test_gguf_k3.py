"""Kimi K3 from llama.cpp's GGUF (docs/kimi-k3-gguf.md), against the HF import of the same weights.

The GGUFs are written by llama.cpp's OWN converter (tests/k3_gguf.py) from deltafind's tiny synthetic K3
HF folder, so everything it changes must come back: the MXFP4 expert records byte for byte, the spine
tensor for tensor, except the fused AttnRes scores (norm = n*p, proj = 1) and `A` (-exp(A_log[:n_head]),
llama.cpp's reading, which the import refuses unless asked).
"""

from __future__ import annotations

import enum
import json
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from deltafind import Model
from deltafind.errors import UnsupportedModelError
from deltafind.importer.checkpoint import open_source
from deltafind.importer.gguf_source import GGUFOptions
from deltafind.importer.hub import open_checkpoint
from deltafind.importer.setup import setup_store
from deltafind.models import kimi_k3
from deltafind.store.manifest import Manifest
from tests.conftest import deltafind_cmd
from tests.hub_server import TOKEN, FakeHub
from tests.k3_gguf import convert_k3, make_k3_hf, need_k3_gguf

OPT_IN = GGUFOptions(llamacpp_k3=True)
PROMPT = [5, 77, 300, 12, 480, 9, 101, 33, 250, 7, 64, 2, 700, 3, 41, 520]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The HF folder and three converter outputs of it: f32, bf16, and bf16 split in two."""
    need_k3_gguf()
    root = tmp_path_factory.mktemp("k3gguf")
    hf = make_k3_hf(root / "hf", seed=0)
    (root / "split").mkdir()
    jobs = {
        "f32": (hf, root / "k3_f32.gguf", "f32", None),
        "bf16": (hf, root / "k3_bf16.gguf", "bf16", None),
        "split": (hf, root / "split" / "k3.gguf", "bf16", 100),  # 189 tensors: two shards
    }
    with ThreadPoolExecutor(3) as pool:  # each is a converter subprocess (~10 s)
        done = {k: pool.submit(convert_k3, *job) for k, job in jobs.items()}
        return {"hf": hf, **{k: f.result() for k, f in done.items()}}


def _check_against_hf(gguf: Path, hf: Path) -> None:
    """Every tensor of the GGUF import equals the HF import's, in dtype and bits, but the two changes."""
    got, want = open_source(gguf, OPT_IN), open_source(hf)
    assert set(got.tensors) == set(want.tensors)
    heads = want.config["text_config"]["num_attention_heads"]
    for name in want.tensors:
        g, w = got.load(name), want.load(name)
        assert got.tensors[name].dtype == g.dtype and tuple(g.shape) == got.tensors[name].shape
        if name.endswith("_res_norm.weight"):  # the converter's fused score, kept in F32
            proj = want.load(name.replace("_res_norm", "_res_proj"))
            assert torch.equal(g, w.float() * proj.float()[0]), name
        elif name.endswith("_res_proj.weight"):
            assert torch.equal(g, torch.ones(w.shape)), name
        elif name.endswith(".A_log"):
            assert torch.equal(g, -torch.exp(w.float()[:heads])), name
        else:  # MXFP4 packs and scales (uint8) included: byte for byte
            assert g.dtype == w.dtype and torch.equal(g, w), name


@pytest.mark.parametrize("outtype", ["f32", "bf16"])
def test_each_converter_output_gives_back_the_release_tensors(
    files: dict[str, Path], outtype: str
) -> None:
    _check_against_hf(files[outtype], files["hf"])


def test_a_split_file_imports_as_the_whole_one(files: dict[str, Path]) -> None:
    split, whole = open_source(files["split"], OPT_IN), open_source(files["bf16"], OPT_IN)
    assert len(split.files) == 2 and split.config == whole.config
    assert split.tensors == whole.tensors
    for name in whole.tensors:
        assert torch.equal(split.load(name), whole.load(name)), name


def test_by_default_the_lossy_decay_rates_are_refused_naming_both_fixes(
    files: dict[str, Path],
) -> None:
    with pytest.raises(UnsupportedModelError) as e:
        open_source(files["bf16"])
    msg = str(e.value)
    assert "keeps 2 of K3's 16 per-channel KDA decay rates" in msg and "96 of 128" in msg
    assert "import the HuggingFace folder" in msg and "--accept-llamacpp-k3" in msg


def test_without_gguf_py_kimi_k3_tables_the_refusal_names_the_fix(
    files: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    import gguf

    # PyPI's gguf 0.19.0 has the same version string as llama.cpp's own, but no KIMI_K3
    pypi = enum.IntEnum(
        "MODEL_ARCH", {m.name: m.value for m in gguf.MODEL_ARCH if m.name != "KIMI_K3"}
    )
    monkeypatch.setattr(gguf, "MODEL_ARCH", pypi)
    with pytest.raises(UnsupportedModelError, match=r"KIMI_K3 tables.*gguf.*`make dev`") as e:
        open_source(files["f32"], OPT_IN)
    assert gguf.__file__ in str(e.value)


def _rewrite(src: Path, dst: Path, meta: dict[str, int], edit: Callable[..., list[tuple]]) -> Path:
    """A copy of the GGUF `src` through gguf-py's writer: `meta` keys replaced (uint32), and each tensor
    (name, data, type) replaced by what `edit` returns for it."""
    import gguf

    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), arch="kimi-k3")
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == gguf.Keys.General.ARCHITECTURE:
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        if f.name in meta:
            w.add_key_value(f.name, meta[f.name], gguf.GGUFValueType.UINT32)
        else:
            w.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
    for t in r.tensors:
        for name, data, kind in edit(t.name, np.array(t.data), t.tensor_type):
            w.add_tensor(name, data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def _widen_experts(name: str, data: np.ndarray, kind: Any) -> list[tuple]:
    import gguf

    if name != "blk.1.ffn_gate_exps.weight":
        return [(name, data, kind)]
    return [(name, gguf.quants.dequantize(data, kind), gguf.GGMLQuantizationType.F32)]


def _q8_spine(name: str, data: np.ndarray, kind: Any) -> list[tuple]:
    import gguf

    if name != "blk.0.attn_q.weight":
        return [(name, data, kind)]
    q8 = gguf.GGMLQuantizationType.Q8_0
    return [(name, gguf.quants.quantize(data, q8), q8)]


def _extra(name: str, data: np.ndarray, kind: Any) -> list[tuple]:
    extra = (
        [("blk.0.extra.weight", np.ones(4, np.float32), kind)] if name == "output.weight" else []
    )
    return [(name, data, kind), *extra]


def _as_is(name: str, data: np.ndarray, kind: Any) -> list[tuple]:
    return [(name, data, kind)]


def _keep(name: str, data: np.ndarray, kind: Any) -> list[tuple]:
    return [] if name == "blk.2.ssm_g.weight" else [(name, data, kind)]


@pytest.mark.parametrize(
    "meta,edit,reason",
    [
        ({}, _widen_experts, r"ffn_gate_exps\.weight is F32: K3's routed experts ship as MXFP4"),
        ({}, _q8_spine, r"attn_q\.weight is Q8_0: .*a block-quantized one is a lossy K3"),
        ({}, _extra, r"blk\.0\.extra\.weight have no place in Kimi K3"),
        ({}, _keep, r"'blk\.2\.ssm_g\.weight' \(.*\) is missing"),
        ({"kimi-k3.kda.head_dim": 2}, _as_is, r"n_head == kda\.head_dim: .* cannot be told apart"),
    ],
    ids=["f32-experts", "q8-spine", "unused-tensor", "missing-tensor", "ambiguous-ssm_a"],
)
def test_what_is_not_k3_as_released_is_refused_with_the_reason(
    files: dict[str, Path], tmp_path: Path, meta: dict, edit: Callable, reason: str
) -> None:
    path = _rewrite(files["f32"], tmp_path / "k3.gguf", meta, edit)
    with pytest.raises(UnsupportedModelError, match=reason):
        open_source(path, OPT_IN)


def test_an_f32_weight_no_bf16_can_hold_stays_f32(files: dict[str, Path], tmp_path: Path) -> None:
    """F32 weights narrow back to bf16 only where every value is a bf16 (the release's); others keep
    the file's values."""
    name, hf = "blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"

    def nudge(n: str, data: np.ndarray, kind: Any) -> list[tuple]:
        return [(n, data * np.float32(1 + 2**-12) if n == name else data, kind)]

    src = open_source(_rewrite(files["f32"], tmp_path / "k3.gguf", {}, nudge), OPT_IN)
    want = open_source(files["hf"]).load(hf).float() * np.float32(1 + 2**-12)
    assert src.tensors[hf].dtype == torch.float32 and torch.equal(src.load(hf), want)
    assert src.tensors["model.layers.0.self_attn.k_proj.weight"].dtype == torch.bfloat16


@pytest.fixture(scope="module")
def stores(files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The GGUF imported by `deltafind setup --accept-llamacpp-k3`, and the HF folder set to llama.cpp's
    reading by hand (per-head A_log[:n_head], kda_a_log_per_channel false): the same weights."""
    root = tmp_path_factory.mktemp("k3stores")
    gguf_store = root / "gguf"
    proc = deltafind_cmd(
        "setup", "--from", str(files["f32"]), "--store", str(gguf_store),
        "--drive", str(root / "g0"), "--dense-slices", "1", "--accept-llamacpp-k3", "--quiet",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "kimi_k3" in proc.stdout and "llama.cpp's reading of Kimi K3" in proc.stdout
    hf = shutil.copytree(files["hf"], root / "hf_per_head")
    cfg = json.loads((hf / "config.json").read_text())
    heads = cfg["text_config"]["num_attention_heads"]
    cfg["text_config"]["kda_a_log_per_channel"] = False
    (hf / "config.json").write_text(json.dumps(cfg))
    for f in hf.glob("*.safetensors"):
        t = load_file(str(f))
        t = {k: v[:heads].clone() if k.endswith(".A_log") else v for k, v in t.items()}
        save_file(t, str(f), metadata={"format": "pt"})
    setup_store(
        hf, root / "hf", [root / "h0"], dense_slices=1, progress=False, names=kimi_k3.WEIGHTS
    )
    return {"gguf": gguf_store, "hf": root / "hf"}


def _records(store: Path) -> list[tuple[tuple[int, int], str]]:
    return [(r.key, r.sha256) for r in Manifest.load(store).experts]


def test_the_store_holds_the_hf_imports_records_and_spine(stores: dict[str, Path]) -> None:
    assert _records(stores["gguf"]) == _records(stores["hf"])  # MXFP4 packs: byte-identical
    got = safe_open(str(stores["gguf"] / "spine.safetensors"), "pt")
    want = safe_open(str(stores["hf"] / "spine.safetensors"), "pt")
    names = set(want.keys())
    assert set(got.keys()) == names
    changed = [n for n in names if not torch.equal(got.get_tensor(n), want.get_tensor(n))]
    assert all("_res_" in n or n.endswith(".A_log") for n in changed) and changed
    config = json.loads((stores["gguf"] / "config.json").read_text())["text_config"]
    assert (config["kda_a_form"], config["kda_a_log_per_channel"]) == ("neg_exp", False)
    proc = deltafind_cmd("doctor", "--store", str(stores["gguf"]), "--quiet")
    assert proc.returncode == 0 and "runs llama.cpp's reading of Kimi K3" in proc.stdout, (
        proc.stderr
    )


def test_logits_equal_the_hf_store_read_as_llama_cpp_reads_it(stores: dict[str, Path]) -> None:
    """Every input bit is the same: the rate -A is the converter's own f32 exp(A_log), and the fused
    score times 1 is the product the HF path folds (attnres.py). So bit-equal is expected; the bound
    leaves room only for a summation-order change, far below any weight or reading difference (the
    per-channel reading is ~4 off on this model, docs/kimi-k3-gguf.md)."""
    got, want = _logits(stores["gguf"]), _logits(stores["hf"])
    assert (got - want).abs().max().item() <= 1e-6 * want.std().item()


def _logits(store: Path) -> torch.Tensor:
    m = Model.open(store, expert_bytes=0, prefetch=False)
    try:
        return m.forward_logits(PROMPT).float()
    finally:
        m.close()


def test_a_per_channel_ssm_a_is_k3_as_released_and_needs_no_flag(
    files: dict[str, Path], tmp_path: Path
) -> None:
    """A converter that kept every rate (ssm_a [kda.head_dim]) would give the release: no refusal, the
    per-channel reading, and the HF store's logits (bit-equal expected, as above)."""
    hf = open_source(files["hf"])
    a_log = {n: hf.load(n) for n in hf.tensors if n.endswith(".A_log")}

    def all_rates(name: str, data: np.ndarray, kind: Any) -> list[tuple]:
        if name.endswith(".ssm_a"):
            layer = int(name.split(".")[1])
            data = (-torch.exp(a_log[f"model.layers.{layer}.self_attn.A_log"].float())).numpy()
        return [(name, data, kind)]

    path = _rewrite(files["f32"], tmp_path / "k3.gguf", {}, all_rates)
    src = open_source(path)  # no opt-in
    text = src.config["text_config"]
    assert text["kda_a_form"] == "neg_exp" and "kda_a_log_per_channel" not in text
    assert "gguf_reading" not in src.config
    stores = {}
    for which, source in (("gguf", src), ("hf", hf)):
        stores[which] = tmp_path / which
        setup_store(
            source,
            stores[which],
            [tmp_path / f"{which}0"],
            1,
            progress=False,
            names=kimi_k3.WEIGHTS,
        )
    got, want = _logits(stores["gguf"]), _logits(stores["hf"])
    assert (got - want).abs().max().item() <= 1e-6 * want.std().item()


def test_delete_source_takes_a_split_k3_gguf_shard_by_shard(
    files: dict[str, Path], stores: dict[str, Path], tmp_path: Path
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    shards = [
        Path(shutil.copy(f, src / f.name)) for f in sorted(files["split"].parent.glob("*.gguf"))
    ]
    store = tmp_path / "s"
    source = open_checkpoint(str(shards[0]), store, delete_source=True, options=OPT_IN)
    setup_store(source, store, [tmp_path / "d0"], 1, progress=False, names=kimi_k3.WEIGHTS)
    assert not any(p.exists() for p in shards)
    # the bf16 split narrows to the very spine the f32 file gave: same bytes, same records
    assert Manifest.load(store).spine_sha256 == Manifest.load(stores["gguf"]).spine_sha256
    assert _records(store) == _records(stores["gguf"])


def test_streaming_a_k3_gguf_is_refused(files: dict[str, Path], tmp_path: Path) -> None:
    """`--streaming` fetches experts by range as stored; K3's are rewritten at import, so it refuses."""
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(files["bf16"], repo / "k3-BF16.gguf")
    with FakeHub({"org/k3-GGUF": repo}) as hub:
        env = {
            "HF_ENDPOINT": hub.endpoint,
            "HF_TOKEN": TOKEN,
            "HF_HUB_OFFLINE": "0",
            "HF_HOME": str(tmp_path / "hf-home"),
        }
        proc = deltafind_cmd(
            "setup", "--from", "org/k3-GGUF:BF16", "--store", str(tmp_path / "s"),
            "--streaming", "--accept-llamacpp-k3", "--quiet", env=env,
        )  # fmt: skip
    assert proc.returncode != 0
    assert "rewritten at import" in proc.stderr and "drop --streaming" in proc.stderr, proc.stderr
