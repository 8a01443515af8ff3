"""Drafting on the demo model (SmolLM2-135M, 30 layers): the same greedy tokens as drafting off,
through Model.generate, the scheduler and the `deltafind run` command."""

from __future__ import annotations

from pathlib import Path

import pytest

from deltafind import Model
from deltafind.engine.draft.ngram import NgramSource
from deltafind.engine.draft.policy import PolicyOptions
from deltafind.engine.sampler import SamplingParams
from deltafind.engine.scheduler import Scheduler, SchedulerLimits, collect
from deltafind.engine.sequence import GenRequest
from tests.conftest import deltafind_cmd

CHATS = [
    "Repeat exactly: red green blue, red green blue.",
    "What is the capital of France?",
    "List the days of the week.",
]


@pytest.fixture(scope="module")
def demo(demo_store: Path) -> Model:
    m = Model.open(demo_store)
    yield m
    m.close()


def test_demo_greedy_tokens_equal_drafting_off(demo: Model) -> None:
    prompts = [demo.tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    for prompt in prompts:
        want = demo.generate(prompt, max_new_tokens=12)
        for draft in ("ngram", "self", "auto"):
            assert demo.generate(prompt, max_new_tokens=12, draft=draft) == want, (draft, prompt)
        assert demo.last_draft_stats.source == "ngram"  # auto chose the n-gram draft


def test_demo_through_the_scheduler_with_concurrent_drafting_sequences(demo: Model) -> None:
    prompts = [demo.tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    want = [demo.generate(p, max_new_tokens=10) for p in prompts]
    sched = Scheduler(
        demo.net,
        demo.eos_token_ids,
        SchedulerLimits(max_running=3),
        draft=NgramSource(),
        draft_policy=PolicyOptions(mode="on"),
    )
    try:
        got = [
            collect(
                sched.submit(GenRequest(tuple(p), SamplingParams(max_new_tokens=10))), timeout=120
            )[0]
            for p in prompts
        ]
    finally:
        sched.close()
    assert got == want
    assert sched.stats.draft.accepted > 0


def test_run_with_a_draft_prints_the_same_text_and_draft_stats(
    demo: Model, demo_store: Path
) -> None:
    ids = demo.tokenizer.apply_chat_template([{"role": "user", "content": CHATS[0]}])
    want = demo.tokenizer.decode(demo.generate(ids, max_new_tokens=12), skip_special_tokens=True)
    proc = deltafind_cmd(
        "run",
        "--store",
        str(demo_store),
        "--chat",
        "--prompt",
        CHATS[0],
        "--max-new",
        "12",
        "--stats",
        "--draft",
        "ngram",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith(want + "\n")  # (log lines may come first)
    assert "[stats] draft ngram (on):" in proc.stderr and "accepted" in proc.stderr
