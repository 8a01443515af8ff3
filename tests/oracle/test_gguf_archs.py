"""Every GGUF architecture deltafind imports, against llama.cpp on the same file, whole and split.

tests/data/gguf_arch_llamacpp_reference.npz holds llama.cpp's teacher-forced logits (llama-cpp-python
0.3.36) for the small random GGUFs tests/gguf_models.py writes, made once by
tests/data/make_gguf_llamacpp_reference.py: building llama-cpp-python would add ~6 min to every CI run,
and the files are rebuilt here from the same seed (their sha256 is checked) instead.

Three checks. Each block type alone (`head_only`: a float model whose output head is that type) reads
as llama.cpp reads it, within HEAD_TOLERANCE. The fp32 twin of each file (every block tensor decoded by
gguf-py) runs in llama.cpp without activation quantization: there deltafind must agree to F32_TOLERANCE (1e-3 of the logits' spread; measured
<= 3.3e-4, deepseek2's MoE the largest). On the block-format file llama.cpp multiplies by activations
quantized to Q8_0/Q8_K while deltafind keeps fp32 (its logits equal the twin's within F32_TOLERANCE), so the
allowed difference is llama.cpp's own: how far its quantized run lies from its fp32 run, position by
position, plus F32_TOLERANCE. These random models amplify that rounding (deepseek2's MLA and sigmoid
routing most: llama.cpp's two runs differ by up to 4.9x the spread there, llama's 0.33, qwen3(moe)'s 0.07),
so top-1 must agree where llama.cpp's margin is clear: its two runs agree on top-1 and its margin is
over twice its own quantization shift at that position.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from deltafind import Model
from deltafind.importer.checkpoint import open_source
from deltafind.importer.setup import setup_store
from deltafind.models.registry import family_module
from tests.gguf_models import HEAD_KINDS, MAKERS, head_only, widened

REF_PATH = Path(__file__).parents[1] / "data" / "gguf_arch_llamacpp_reference.npz"
REF = dict(np.load(REF_PATH))
SEED = 7  # tests/data/make_gguf_llamacpp_reference.py's
F32_TOLERANCE = 1e-3  # max |ours - llama.cpp| / std(llama.cpp's logits), on the fp32 twins


def _logits(source: Path, store: Path) -> np.ndarray:
    config = open_source(source).config
    family = family_module(config["model_type"])
    setup_store(
        source,
        store,
        progress=False,
        names=family.weight_names(family.ModelArgs.from_config(config)),
    )
    model = Model.open(store)
    try:
        return model.forward_logits([int(t) for t in REF["tokens"]]).float().numpy()
    finally:
        model.close()


def _check_file(whole: Path, key: str) -> None:
    assert hashlib.sha256(whole.read_bytes()).hexdigest() == str(REF[key]), (
        "tests/gguf_models.py no longer writes the file the reference was made from; "
        "run tests/data/make_gguf_llamacpp_reference.py"
    )


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
@pytest.mark.parametrize("arch", sorted(MAKERS))
def test_teacher_forced_logits_agree_with_llamacpp(arch: str, split: bool, tmp_path: Path) -> None:
    whole = MAKERS[arch](SEED).write(tmp_path / f"{arch}.gguf")[0]
    _check_file(whole, f"{arch}_sha256")
    if split:
        (tmp_path / "split").mkdir()
        source = MAKERS[arch](SEED).write(tmp_path / "split" / f"{arch}.gguf", shards=2)[
            -1
        ]  # from the last shard
    else:
        source = whole
    ours, ref, ref_f32 = (
        _logits(source, tmp_path / "store"),
        REF[f"{arch}_logits"],
        REF[f"{arch}_f32_logits"],
    )
    clear = agree_within_llamacpp_shift(ours, ref, ref_f32)
    assert clear >= 8  # of 48 (deepseek2 has the fewest: 10)


def agree_within_llamacpp_shift(ours: np.ndarray, ref: np.ndarray, ref_f32: np.ndarray) -> int:
    """Assert fp32 logits `ours` [T, V] lie within llama.cpp's own activation rounding (its block-format
    run `ref` against its fp32-twin run `ref_f32`) plus F32_TOLERANCE, and share its top-1 where its
    margin is clear (see the module docstring); return how many positions were clear."""
    spread = float(ref.std())
    shift = np.abs(ref - ref_f32).max(
        -1, keepdims=True
    )  # [T, 1] llama.cpp's own activation rounding
    assert (np.abs(ours - ref) <= shift + F32_TOLERANCE * spread).all()
    top2 = np.sort(ref, axis=-1)[:, -2:]
    clear = (ref.argmax(-1) == ref_f32.argmax(-1)) & (top2[:, 1] - top2[:, 0] > 2 * shift[:, 0])
    assert (ours.argmax(-1)[clear] == ref.argmax(-1)[clear]).all()
    return int(clear.sum())


@pytest.mark.parametrize("arch", sorted(MAKERS))
def test_fp32_twin_agrees_with_llamacpp_to_float_rounding(arch: str, tmp_path: Path) -> None:
    twin = widened(MAKERS[arch](SEED)).write(tmp_path / f"{arch}.gguf")[0]
    _check_file(twin, f"{arch}_f32_sha256")
    ours, ref = _logits(twin, tmp_path / "store"), REF[f"{arch}_f32_logits"]
    assert float(np.abs(ours - ref).max()) <= F32_TOLERANCE * float(ref.std())
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


# llama.cpp rounds the head's input to Q8_K (Q8_0 for IQ4_NL): a step of max/127 per 256 values, which moves
# each logit by a few % of the spread (measured at most 4.9e-2, IQ3_XXS). A misread block (grid entry, sign
# or scale) moves logits by the order of their spread.
HEAD_TOLERANCE = 0.1


@pytest.mark.parametrize("kind", HEAD_KINDS)
def test_each_block_type_reads_as_llamacpp_reads_it(kind: str, tmp_path: Path) -> None:
    path = head_only(kind, SEED).write(tmp_path / "head.gguf")[0]
    _check_file(path, f"head_{kind}_sha256")
    ref = REF[f"head_{kind}_logits"]
    ours = _logits(path, tmp_path / "store")[: len(ref)]
    assert (
        open_source(path).tensors["lm_head.weight"].quant == f"{kind}/256"
    )  # kept as stored, not widened
    assert float(np.abs(ours - ref).max()) <= HEAD_TOLERANCE * float(ref.std())


# llama.cpp's own arithmetic: `[device] math = "q8"` quantizes activations as llama.cpp does for the
# Q4_K/Q5_K/Q6_K/Q8_0 matmuls, so its logits land nearer llama.cpp's block-format run than exact fp32 does
# (measured mean |d| over the spread: llama 0.0224 -> 0.0102, qwen2 0.0214 -> 0.0118; the max 0.32 ->
# 0.19 and 0.36 -> 0.12). qwen3, qwen3moe and deepseek2 are left out: there exact and q8 lie equally far
# (0.07, 0.07, 4.9 of the spread), their Q3_K/IQ layers, which q8 leaves exact, carrying llama.cpp's rounding.
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_q8_math_lands_nearer_llamacpp_than_exact(arch: str, tmp_path: Path) -> None:
    from deltafind.control.ctl import store_lines
    from deltafind.models.ops import fast_math

    whole = MAKERS[arch](SEED).write(tmp_path / f"{arch}.gguf")[0]
    _check_file(whole, f"{arch}_sha256")
    exact = _logits(whole, tmp_path / "store")
    model = Model.open(tmp_path / "store", math="q8")
    try:
        q8 = model.forward_logits([int(t) for t in REF["tokens"]]).float().numpy()
        assert model.snapshot()["math"] == "q8"
        assert "NOT bit-exact" in "\n".join(store_lines(model.snapshot()))
    finally:
        model.close()
        fast_math.use("exact")  # the mode is the process's
    ref = REF[f"{arch}_logits"]
    assert np.abs(q8 - ref).mean() < 0.75 * np.abs(exact - ref).mean()
    assert np.abs(q8 - ref).max() < 0.75 * np.abs(exact - ref).max()
