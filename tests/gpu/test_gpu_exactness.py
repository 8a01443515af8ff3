"""Greedy tokens on the accelerator equal the CPU path on tiny stores; logits within a stated tolerance.

Tolerance: fp32 on both sides (TF32 off), so they differ by summation order only:
max |logit_gpu - logit_cpu| <= 1e-3 * max(1, max |logit_cpu|). Tokens must be equal.
Device cache hit vs miss and prefetch on vs off must not change a single bit.
"""

from __future__ import annotations

from pathlib import Path

import torch

from deltafind.api import Model
from deltafind.device.device_cache import DeviceExpertCache, headroom_bytes, memory_info

PROMPT = "Exactness on the device"


def _run(store: Path, device: str, **kw: object) -> tuple[list[int], torch.Tensor, Model]:
    model = Model.open(store, device=device, **kw)
    ids = model.tokenizer.encode(PROMPT)
    return model.generate(ids, max_new_tokens=12), model.forward_logits(ids).cpu(), model


def test_greedy_tokens_equal_cpu(accel: torch.device, tiny_store: Path) -> None:
    want, want_logits, cpu = _run(tiny_store, "cpu", expert_bytes=0)
    cpu.close()
    got, got_logits, dev = _run(tiny_store, str(accel), expert_bytes=0)
    try:
        assert dev.net.model.embed_tokens.weight.device.type == accel.type
        assert got == want
        assert (got_logits - want_logits).abs().max() <= 1e-3 * max(
            1.0, float(want_logits.abs().max())
        )
    finally:
        dev.close()


def test_device_cache_hit_miss_and_prefetch_are_bit_identical(
    accel: torch.device, k3_store: Path
) -> None:
    runs = []
    for cache, prefetch in ((0, False), (0, True), (None, True)):
        model = Model.open(k3_store, device=str(accel), expert_bytes=cache, prefetch=prefetch)
        ids = model.tokenizer.encode(PROMPT)
        toks = model.generate(ids, max_new_tokens=8)
        again = model.generate(
            ids, max_new_tokens=8
        )  # second pass: served from the device cache when it has one
        logits = model.forward_logits(ids).cpu()
        if cache is None:
            assert (
                isinstance(model.experts.cache, DeviceExpertCache) and len(model.experts.cache) > 0
            )
            key = next(
                r.key for r in model.experts.manifest.experts if r.key in model.experts.cache
            )
            hit = model.experts.cache.get(key)
            assert hit is not None and all(
                t.device.type == accel.type for t in hit.tensors.values()
            )
            _, total = memory_info(accel)
            assert model.experts.cache.budget_bytes <= total - headroom_bytes(total)
        model.close()
        assert toks == again
        runs.append((toks, logits))
    for toks, logits in runs[1:]:
        assert toks == runs[0][0] and torch.equal(logits, runs[0][1])
