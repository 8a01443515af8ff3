"""One bad expert record fails only the sequences whose rows routed it; their step-mates' tokens stay solo-exact.

A real store (tiny qwen3_moe on two drives; a synthetic tiny Kimi K3) with one byte flipped in one routed expert's record, read
on every step (no cache): twelve sequences batched in the daemon's Scheduler against each one run
alone. Which prompts route the bad expert is found on the intact store, by the routes the model
reports to its provider.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from deltafind import Model
from deltafind.engine.generate import generate
from deltafind.engine.sampler import SamplingParams
from deltafind.engine.scheduler import Scheduler, SchedulerLimits, collect
from deltafind.engine.sequence import GenRequest
from deltafind.errors import CorruptExpertError
from deltafind.importer.setup import setup_store
from deltafind.importer.synthetic import open_synthetic
from deltafind.models import kimi_k3
from tests.conftest import make_hf_checkpoint

PROMPTS = [[t] for t in (3, 17, 40, 66, 90, 111, 135, 160, 188, 201, 230, 249)]
PARAMS = SamplingParams(max_new_tokens=4, ignore_eos=True)


def _routes(m: Model, prompt: list[int]) -> set[tuple[int, int]]:
    """(layer, expert) pairs one greedy run of `prompt` routes, as the model reports them to its provider."""
    seen: set[tuple[int, int]] = set()
    observe = m.experts.observe_routes

    def record(layer_idx, topk_idx, topk_weight):
        seen.update((layer_idx, e) for e in topk_idx.flatten().tolist())
        return observe(layer_idx, topk_idx, topk_weight)

    m.experts.observe_routes = record
    try:
        list(generate(m.net, prompt, PARAMS, m.eos_token_ids))
    finally:
        m.experts.observe_routes = observe
    return seen


def _setup(family: str, root: Path, name: str) -> Path:
    # KDA layers: a step-mate's recurrent state is prefilled again, not cut back
    if family == "kimi_k3":
        setup_store(
            open_synthetic("kimi_k3", "tiny", seed=3),
            root / name,
            [root / f"{name}0"],
            dense_slices=2,
            progress=False,
            names=kimi_k3.WEIGHTS,
        )
    else:
        ckpt = make_hf_checkpoint(
            family, root / "hf", num_hidden_layers=2, num_experts=16, num_experts_per_tok=2
        )
        setup_store(ckpt, root / name, [root / f"{name}0", root / f"{name}1"], progress=False)
    return root / name


@pytest.fixture(scope="module", params=["qwen3_moe", "kimi_k3"])
def stores(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path, tuple[int, int], list[bool]]:
    """(intact store, the same store with one corrupt record, that record's key, which prompts route it)."""
    root = tmp_path_factory.mktemp(request.param)
    m = Model.open(_setup(request.param, root, "good"), expert_bytes=0, prefetch=False)
    try:
        routes = [_routes(m, p) for p in PROMPTS]
    finally:
        m.close()
    counts = Counter(k for r in routes for k in r)
    key = min(
        (k for k, n in counts.items() if n < len(PROMPTS)), key=lambda k: (counts[k], k)
    )  # some prompts only
    bad = Model.open(
        _setup(request.param, root, "bad"), expert_bytes=0, prefetch=False
    )  # the same store, to damage
    try:
        rec, pack = (
            bad.experts.record(*key),
            bad.experts.reader.paths[bad.experts.record(*key).drive],
        )
    finally:
        bad.close()
    with open(pack, "r+b") as f:  # one flipped byte in the middle of the record
        f.seek(rec.offset + rec.length // 2)
        b = f.read(1)
        f.seek(rec.offset + rec.length // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    return root / "good", root / "bad", key, [key in r for r in routes]


def test_a_corrupt_expert_fails_only_the_sequences_that_route_it(stores) -> None:
    good, bad, (layer, expert), routed = stores
    ok = Model.open(good, expert_bytes=0, prefetch=False)
    try:
        solo = [list(generate(ok.net, p, PARAMS, ok.eos_token_ids)) for p in PROMPTS]
    finally:
        ok.close()
    m = Model.open(bad, expert_bytes=0, prefetch=False)
    try:
        # alone, a prompt fails exactly when it routes the record
        for p, hit in zip(PROMPTS, routed, strict=True):
            if hit:
                with pytest.raises(CorruptExpertError):
                    list(generate(m.net, p, PARAMS, m.eos_token_ids))
        sched = Scheduler(
            m.net,
            m.eos_token_ids,
            SchedulerLimits(max_running=len(PROMPTS), max_queue=len(PROMPTS)),
        )
        try:  # all twelve in the same steps: queued while the engine thread is held
            sched.call_soon(lambda: time.sleep(0.5))
            with capture_logs() as logs:
                handles = [sched.submit(GenRequest(tuple(p), PARAMS)) for p in PROMPTS]
                results = [collect(h, timeout=60) for h in handles]
            assert sched.snapshot()["max_batch"] >= len(PROMPTS) - sum(
                routed
            )  # the survivors' steps, counted after the retry
        finally:
            sched.close()
    finally:
        m.close()
    for (tokens, fin), hit, want in zip(results, routed, solo, strict=True):
        if hit:
            assert fin.reason == "error"
            assert (
                f"expert {expert} of layer {layer}" in fin.error
                and "checksum mismatch" in fin.error
            )
            assert (
                f"{bad.parent}/bad" in fin.error and ".pack at offset" in fin.error
            )  # the pack and where in it
            assert isinstance(fin.exception, CorruptExpertError)
        else:
            assert (tokens, fin.reason) == (
                want,
                "length",
            )  # step-mates of the failures: as alone on the intact store
    assert 0 < sum(routed) < len(PROMPTS)
    # a KDA state cannot be cut back one decode row: it was prefilled again
    if m.manifest.family == "kimi_k3":
        assert any(e["event"] == "sequence_recomputed" for e in logs)
