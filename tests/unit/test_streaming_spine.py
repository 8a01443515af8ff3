"""Spine prefix residency: any `spine_bytes` gives the all-resident output bit for bit, within budget."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from deltafind import Model
from deltafind.errors import StoreError
from deltafind.importer.setup import setup_store
from deltafind.importer.synthetic import open_synthetic
from deltafind.models import kimi_k3
from deltafind.models.ops.stored import stored_weight_names
from deltafind.store.manifest import SPINE_NAME
from deltafind.store.spine import plan_spine, read_layout
from tests.conftest import make_hf_checkpoint

PROMPT = [11, 42, 7, 99, 3, 150]
NEW = 8


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spine")
    out = {}
    for family, extra in {
        "qwen3_moe": {"num_hidden_layers": 4, "mlp_only_layers": [0], "num_experts": 8},
        "deepseek_v3": {"num_hidden_layers": 4},  # MLA, a router bias buffer, shared experts
        "llama": {"num_hidden_layers": 3, "tie_word_embeddings": True},
    }.items():
        ckpt = make_hf_checkpoint(family, root / f"hf-{family}", **extra)
        out[family] = root / family
        setup_store(ckpt, out[family], [root / f"{family}-d0"], dense_slices=2, progress=False)
    out["kimi_k3"] = root / "kimi_k3"
    setup_store(
        open_synthetic("kimi_k3", "tiny", seed=3),
        out["kimi_k3"],
        [root / "k3-d0"],
        dense_slices=2,
        progress=False,
        names=kimi_k3.WEIGHTS,
    )
    return out


def _layer_sizes(
    store: Path, num_layers: int, keep: set[str] = frozenset()
) -> tuple[int, list[int]]:
    """Always-resident bytes and each layer's bytes, as Model.open holds them (`keep`: weights held as stored)."""
    plan = plan_spine(read_layout(store / SPINE_NAME, torch.float32, keep), num_layers, None)
    return sum(t.resident_bytes for t in plan.always), [
        sum(t.resident_bytes for t in plan.layers.get(i, [])) for i in range(num_layers)
    ]


def _held_bytes(net: torch.nn.Module) -> int:
    """Bytes of every materialised parameter and buffer of the model (independent of the plan)."""
    seen, total = set(), 0
    for t in [*net.parameters(), *net.buffers()]:
        if t.device.type != "meta" and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "llama", "kimi_k3"])
def test_every_budget_gives_the_all_resident_output(stores, family) -> None:
    store = stores[family]
    ref = Model.open(store, expert_bytes=0, prefetch=False)
    try:
        n, keep = ref.net.num_layers, stored_weight_names(ref.net)
        logits, tokens = ref.forward_logits(PROMPT), ref.generate(PROMPT, max_new_tokens=NEW)
    finally:
        ref.close()
    base, sizes = _layer_sizes(store, n, keep)
    two = 2 * max(sizes)
    # (resident layers, budget): 0 extra layers, one byte short of 1, 1, and n - 3 (n - 2 resident would leave
    # two streamed layers, which cost exactly what they save, so that budget keeps everything resident)
    budgets = [(0, base + two), (0, base + two + sizes[0] - 1)]
    if n >= 4:
        budgets.append((1, base + sizes[0] + two))
    if n - 3 > 1:
        budgets.append((n - 3, base + sum(sizes[: n - 3]) + two))
    for resident, budget in budgets:
        m = Model.open(store, expert_bytes=0, prefetch=True, spine_bytes=budget)
        try:
            assert m.spine is not None and m.spine.plan.resident_layers == resident
            assert torch.equal(m.forward_logits(PROMPT), logits)
            peak = 0
            real_enter = m.spine.enter

            def enter(i: int, real_enter=real_enter, m=m) -> None:
                nonlocal peak
                real_enter(i)
                peak = max(peak, _held_bytes(m.net))

            m.spine.enter = enter
            assert m.generate(PROMPT, max_new_tokens=NEW) == tokens
            assert 0 < peak <= budget  # never over the budget, counted from the model's own tensors
            streamed = n - resident
            if streamed > 2:  # more streamed layers than held slots: every step re-reads them
                assert m.spine.layers_read >= NEW * streamed
        finally:
            m.close()


def test_budget_that_fits_everything_streams_nothing(stores) -> None:
    store = stores["qwen3_moe"]
    base, sizes = _layer_sizes(store, 4)
    m = Model.open(store, spine_bytes=base + sum(sizes))
    try:
        assert m.spine is None and m.experts.spine is None
    finally:
        m.close()


def test_budget_below_the_minimum_names_the_key_and_the_minimum(stores) -> None:
    store = stores["qwen3_moe"]
    base, sizes = _layer_sizes(store, 4)
    with pytest.raises(
        StoreError,
        match=re.escape(
            f"spine_bytes = {base} is below the minimum of {base + 2 * max(sizes)} bytes"
        ),
    ):
        Model.open(store, spine_bytes=base)


def test_truncated_spine_fails_the_request_and_the_engine_keeps_serving(stores) -> None:
    store = stores["qwen3_moe"]
    base, sizes = _layer_sizes(store, 4)
    m = Model.open(store, expert_bytes=0, prefetch=False, spine_bytes=base + 2 * max(sizes))
    spine = store / SPINE_NAME
    original = spine.read_bytes()
    try:
        ref = m.generate(PROMPT, max_new_tokens=3)
        last = max(t.offset for ts in m.spine.plan.layers.values() for t in ts)
        spine.write_bytes(original[: last + 8])
        with pytest.raises(
            StoreError, match=r"short read of model\.layers\..*the spine is truncated"
        ):
            for _ in range(3):  # the layers held from the previous step may cover one step
                m.generate(PROMPT, max_new_tokens=3)
        spine.write_bytes(original)
        assert m.generate(PROMPT, max_new_tokens=3) == ref
    finally:
        spine.write_bytes(original)
        m.close()


def _vm_locked_kib() -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(r"VmLck:\s+(\d+) kB", text)[1])


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmLck from Linux /proc")
def test_resident_spine_is_locked_where_allowed(stores) -> None:
    store = stores["llama"]
    before = _vm_locked_kib()
    m = Model.open(store, spine_bytes=None)
    try:
        if m.memory_lock.refused:
            pytest.skip("mlock refused here (RLIMIT_MEMLOCK); the refusal is logged")
        assert m.memory_lock.locked_bytes > 0
        assert (
            _vm_locked_kib() - before >= m.memory_lock.locked_bytes // 1024 - 8
        )  # the kernel sees it locked
    finally:
        m.close()
    assert _vm_locked_kib() <= before + 8
