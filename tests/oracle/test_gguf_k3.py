"""Kimi K3 from llama.cpp's GGUF, against llama.cpp on the same file, whole and split.

tests/data/k3_gguf_llamacpp_reference.npz holds llama.cpp's teacher-forced logits (llama-cpp-python
0.3.36) on the f32 GGUF that llama.cpp's own converter writes from deltafind's tiny synthetic K3 (its
routed experts stay MXFP4), and on that file's fp32 twin (experts dequantized by gguf-py), made once by
tests/data/make_k3_gguf_llamacpp_reference.py. Here the converter runs again (tests/k3_gguf.py; the
file's sha256 must be the reference's) and deltafind imports it with the opt-in to llama.cpp's reading
of K3 (docs/kimi-k3-gguf.md: 96 of 128 decay rates, one per head). deltafind computes the MXFP4
experts exactly in fp32, so it must agree with the twin's run to F32_TOLERANCE (measured 6.7e-5 of the
spread) and with the MXFP4 file's run by test_gguf_archs.py's rule for llama.cpp's own activation
quantization, top-1 equal where llama.cpp's margin is clear (24 of 48 positions).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import gguf
import numpy as np
import pytest

from deltafind import Model
from deltafind.importer.checkpoint import open_source
from deltafind.importer.gguf_source import GGUFOptions
from deltafind.importer.setup import setup_store
from deltafind.models.registry import family_module
from tests.k3_gguf import convert_k3, make_k3_hf, need_k3_gguf
from tests.oracle.test_gguf_archs import F32_TOLERANCE, agree_within_llamacpp_shift

REF = dict(np.load(Path(__file__).parents[1] / "data" / "k3_gguf_llamacpp_reference.npz"))
SEED = 7  # tests/data/make_k3_gguf_llamacpp_reference.py's


@pytest.fixture(scope="module")
def k3_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The converter's f32 K3 GGUF, whole and split in two (the split's last shard)."""
    need_k3_gguf()
    tmp = tmp_path_factory.mktemp("k3_gguf")
    hf = make_k3_hf(tmp / "hf", SEED)
    whole = convert_k3(hf, tmp / "k3.gguf", "f32")
    (tmp / "split").mkdir()
    n_tensors = len(gguf.GGUFReader(whole).tensors)
    convert_k3(hf, tmp / "split" / "k3.gguf", "f32", -(-n_tensors // 2))
    return {"whole": whole, "split": sorted((tmp / "split").glob("k3-*-of-*.gguf"))[-1]}


def test_converter_writes_the_file_the_reference_was_made_from(k3_files: dict[str, Path]) -> None:
    sha = hashlib.sha256(k3_files["whole"].read_bytes()).hexdigest()
    assert sha == str(REF["sha256"]), (
        f"llama.cpp's converter now writes {sha} from tests/k3_gguf.py's K3, not the file the "
        "reference was made from: run tests/data/make_k3_gguf_llamacpp_reference.py"
    )


def _logits(path: Path, store: Path) -> np.ndarray:
    source = open_source(path, GGUFOptions(llamacpp_k3=True))
    family = family_module(source.config["model_type"])
    names = family.weight_names(family.ModelArgs.from_config(source.config))
    setup_store(source, store, progress=False, names=names)
    model = Model.open(store)
    try:
        return model.forward_logits([int(t) for t in REF["tokens"]]).float().numpy()
    finally:
        model.close()


@pytest.mark.parametrize("split", ["whole", "split"])
def test_teacher_forced_logits_agree_with_llamacpp(
    split: str, k3_files: dict[str, Path], tmp_path: Path
) -> None:
    ours = _logits(k3_files[split], tmp_path / "store")
    ref, ref_f32 = REF["logits"], REF["f32_logits"]
    assert float(np.abs(ours - ref_f32).max()) <= F32_TOLERANCE * float(ref_f32.std())
    assert (ours.argmax(-1) == ref_f32.argmax(-1)).all()
    assert agree_within_llamacpp_shift(ours, ref, ref_f32) >= 16  # of 48 (24 measured)
