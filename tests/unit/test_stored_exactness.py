"""Models compute on bf16 weights as stored and match the fp32-widened path (the oracle).

Every family's bf16 checkpoint, opened as stored and opened widened (`stored.widened()`):
logits within fp32 summation-order noise (1e-5 relative) and identical greedy tokens; the
stored model really holds its matmul weights in bf16.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltafind import Model
from deltafind.importer.setup import setup_store
from deltafind.importer.synthetic import open_synthetic
from deltafind.models import kimi_k3
from deltafind.models.ops.stored import StoredEmbedding, StoredLinear, widened
from tests.conftest import make_hf_checkpoint

HF = ["llama", "qwen3", "qwen3_moe", "deepseek_v3"]


def _store(family: str, root: Path) -> Path:
    store = root / "store"
    if family == "kimi_k3":
        setup_store(
            open_synthetic("kimi_k3", "tiny", seed=2),
            store,
            [root / "d0"],
            dense_slices=2,
            progress=False,
            names=kimi_k3.WEIGHTS,
        )
    else:
        hf = make_hf_checkpoint(family, root / "hf", seed=5, dtype="bfloat16")
        setup_store(hf, store, [root / "d0", root / "d1"], dense_slices=2, progress=False)
    return store


@pytest.mark.parametrize("family", [*HF, "kimi_k3"])
def test_stored_bf16_equals_widened(family: str, tmp_path: Path) -> None:
    store = _store(family, tmp_path)
    ids = torch.randint(3, 200, (12,), generator=torch.Generator().manual_seed(1)).tolist()
    with widened():
        wide = Model.open(store)
    try:
        ref, ref_tokens = wide.forward_logits(ids), wide.generate(ids, max_new_tokens=8)
        assert not any(isinstance(m, StoredLinear) for m in wide.net.modules())
    finally:
        wide.close()
    stored = Model.open(store)
    try:
        linears = [m for m in stored.net.modules() if isinstance(m, StoredLinear)]
        assert linears and all(
            m.weight.dtype == torch.bfloat16 for m in linears if m.weight.device.type != "meta"
        )
        assert any(isinstance(m, StoredEmbedding) for m in stored.net.modules())
        got = stored.forward_logits(ids)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
        assert stored.generate(ids, max_new_tokens=8) == ref_tokens
    finally:
        stored.close()


def test_demo_gguf_blocks_equal_widened(demo_store: Path) -> None:
    """The demo's Q4_1/Q8_0 blocks stay blocks in memory and give the fp32-decoded path's logits."""
    with widened():
        wide = Model.open(demo_store)
    try:
        ids = wide.tokenizer.encode("The capital of France is")
        ref, ref_tokens = wide.forward_logits(ids), wide.generate(ids, max_new_tokens=8)
    finally:
        wide.close()
    stored = Model.open(demo_store)
    try:
        head = stored.net.lm_head
        assert (
            isinstance(head, StoredLinear)
            and head.quant.startswith("Q8_0/")
            and head.weight.dtype == torch.uint8
        )
        got = stored.forward_logits(ids)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
        assert stored.generate(ids, max_new_tokens=8) == ref_tokens
        held = sum(p.numel() * p.element_size() for p in stored.net.parameters())
        wide_bytes = sum(p.numel() * p.element_size() for p in wide.net.parameters())
        assert held < 0.35 * wide_bytes  # Q4_1/Q8_0 blocks: ~0.16-0.27 of fp32
    finally:
        stored.close()


def test_int8_spine_is_opt_in_halves_the_spine_and_stays_close(tmp_path: Path) -> None:
    """[cache] spine_int8 (docs/kimi-k3-drafting-io.md §9.6) is not weight-exact: held as int8 rows, about half the bf16
    bytes, and close to the stored model (the bench prints the drift; here a loose sanity bound)."""
    store = _store("llama", tmp_path)
    ids = torch.randint(3, 200, (12,), generator=torch.Generator().manual_seed(4)).tolist()
    ref = Model.open(store)
    try:
        want, ref_bytes = (
            ref.forward_logits(ids),
            sum(p.numel() * p.element_size() for p in ref.net.parameters()),
        )
    finally:
        ref.close()
    m = Model.open(store, spine_int8=True)
    try:
        held = sum(p.numel() * p.element_size() for p in m.net.parameters())
        assert m.net.lm_head.quant.startswith("I8R/") and m.net.lm_head.weight.dtype == torch.uint8
        assert held < 0.6 * ref_bytes
        got = m.forward_logits(ids)
        assert not torch.equal(got, want)  # not weight-exact, and it says so
        assert float((got - want).abs().mean()) < 0.05 * float(want.std())
    finally:
        m.close()
