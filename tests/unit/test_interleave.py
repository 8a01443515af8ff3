"""Chunked prefill beside decode: a long prompt never stalls a running stream, and a cancel lands between chunks.

A real MoE store (tiny qwen3_moe, experts read from the pack every step) behind the daemon's Scheduler,
with the limits the daemon builds (a step may hold the whole context): only the step time target
(engine/step_budget.py) cuts the long prompt. Outputs are compared with one-pass synchronous runs.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from deltafind import Model
from deltafind.engine.generate import generate
from deltafind.engine.sampler import SamplingParams
from deltafind.engine.scheduler import Scheduler, SchedulerLimits, collect
from deltafind.engine.sequence import FinishEvent, GenRequest
from deltafind.engine.step_budget import FIRST_CHUNK, MIN_CHUNK, StepBudget
from deltafind.importer.setup import setup_store
from tests.conftest import make_hf_checkpoint

CONTEXT = 2048
LONG = [(7 * i + 3) % 250 + 1 for i in range(1500)]
SHORT = [11, 42, 7]
TARGET_S = 0.05


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("interleave")
    ckpt = make_hf_checkpoint(
        "qwen3_moe",
        root / "hf",
        num_hidden_layers=2,
        num_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=CONTEXT,
    )
    setup_store(ckpt, root / "store", [root / "d0"], dense_slices=2, progress=False)
    m = Model.open(Path(root / "store"), expert_bytes=0, prefetch=False)
    yield m
    m.close()


def _daemon_limits(target_s: float | None) -> SchedulerLimits:
    # as daemon/runtime.py builds them with max_prefill_tokens unset: a step may hold the whole context
    return SchedulerLimits(
        max_running=4,
        max_queue=8,
        max_step_tokens=CONTEXT,
        max_context=CONTEXT,
        step_target_s=target_s,
    )


def _solo(model: Model, prompt: list[int], params: SamplingParams) -> list[int]:
    return list(generate(model.net, prompt, params, model.eos_token_ids))


def test_a_long_prompt_prefills_in_chunks_while_a_running_stream_keeps_emitting(
    model: Model,
) -> None:
    stream_params = SamplingParams(max_new_tokens=400, ignore_eos=True)
    long_params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    sched = Scheduler(model.net, model.eos_token_ids, _daemon_limits(TARGET_S))
    tokens, stamps = [], []

    def follow(h) -> None:  # the stream's client: each token stamped as it arrives
        while (event := h.get(timeout=60)) is not None and not isinstance(event, FinishEvent):
            tokens.append(event.token_id)
            stamps.append(time.monotonic())

    try:
        reader = threading.Thread(
            target=follow, args=(sched.submit(GenRequest(tuple(SHORT), stream_params)),)
        )
        reader.start()
        while len(stamps) < 2:  # the stream runs before the long prompt arrives
            time.sleep(0.001)
        steps0 = sched.stats.steps
        submitted = time.monotonic()
        long = sched.submit(GenRequest(tuple(LONG), long_params))
        first = long.get(timeout=120)
        assert first is not None and not isinstance(first, FinishEvent)
        first_at = time.monotonic()
        prefill_steps = sched.stats.steps - steps0
        long_tokens, long_fin = collect(long, timeout=60)
        reader.join(120)
    finally:
        sched.close()
    during = [t for t in stamps if submitted <= t <= first_at]
    # several prefill steps, each with the stream's decode row beside it (today: one step of the whole prompt)
    assert prefill_steps >= 4 and len(during) >= 3, (prefill_steps, len(during))
    assert long_fin.reason == "length"
    assert tokens == _solo(
        model, SHORT, stream_params
    )  # chunking and batching never change a token
    assert [first.token_id, *long_tokens] == _solo(model, LONG, long_params)


def test_a_cancel_during_prefill_ends_it_between_chunks_and_frees_its_slot(model: Model) -> None:
    sched = Scheduler(model.net, model.eos_token_ids, _daemon_limits(TARGET_S))
    try:
        h = sched.submit(GenRequest(tuple(LONG), SamplingParams(max_new_tokens=5)))
        deadline = time.monotonic() + 60
        while sched.stats.prompt_tokens == 0 and time.monotonic() < deadline:  # the first chunk ran
            time.sleep(0.001)
        h.cancel()
        cancelled_at = time.monotonic()
        tokens, fin = collect(h, timeout=30)
        took = time.monotonic() - cancelled_at
        snap = sched.snapshot()
        assert (
            snap["step_target_s"] == TARGET_S and snap["prefill_chunk_tokens"] >= 1
        )  # status shows the chunk
        assert fin.reason == "cancelled" and tokens == [] and fin.completion_tokens == 0
        assert snap["prompt_tokens"] < len(LONG)  # the rest of the prompt never ran
        assert took < 5.0  # within a chunk or so (its steps aim at TARGET_S)
        assert (
            snap["running"] == 0 and sched.core.running == []
        )  # the slot, its cache with it, is free
        # and the engine serves the next request at once
        assert (
            collect(
                sched.submit(GenRequest(tuple(SHORT), SamplingParams(max_new_tokens=2))), timeout=30
            )[1].reason
            == "length"
        )
    finally:
        sched.close()


def test_the_budget_fits_the_target_but_never_less_than_a_steps_fixed_part() -> None:
    b = StepBudget(target_s=0.5)
    assert b.prefill_tokens() == FIRST_CHUNK  # nothing measured yet
    b.observe(0, step_s=0.1)  # a decode step: the part every step pays
    b.observe(FIRST_CHUNK, step_s=0.1 + FIRST_CHUNK * 0.001)  # 1 ms a prompt token on top
    assert (
        b.prefill_tokens() == 2 * FIRST_CHUNK
    )  # (0.5 - 0.1) / 1 ms = 400, but at most double a step
    for _ in range(5):
        b.observe(b.prefill_tokens(), step_s=0.1 + b.prefill_tokens() * 0.001)
    assert b.prefill_tokens() == 400
    assert (
        b.prefill_tokens(alone=True) == 800
    )  # nobody decodes beside it: 4 targets, at most double the last step
    slow = StepBudget(
        target_s=0.5
    )  # a step's fixed part (passes, expert reads) near the target: a loaded host,
    for _ in range(8):  # a slow drive: chunks as long as that part, not a token or two
        slow.observe(0, step_s=0.45)
        slow.observe(slow.prefill_tokens(), step_s=0.45 + slow.prefill_tokens() * 0.01)
    assert (
        slow.prefill_tokens() == MIN_CHUNK
    )  # 45 by time, but never under the kernels' multi-row floor
    assert StepBudget(target_s=None).prefill_tokens() is None
