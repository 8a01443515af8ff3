"""Drafting through the scheduler: several concurrent sequences, each drafting, in shared steps.

Greedy output must equal `generate` with drafting off, token for token, across
EOS, stop ids and max-token cuts, with prefill chunks in the same steps; a draft
that fails, or a verify pass that fails, falls back to target-only for that
request with a log line, and no request fails.
"""

from __future__ import annotations

import pytest
import torch
from structlog.testing import capture_logs

from deltafind import Model
from deltafind.engine.draft.ngram import NgramSource
from deltafind.engine.draft.policy import PolicyOptions
from deltafind.engine.generate import generate
from deltafind.engine.sampler import SamplingParams
from deltafind.engine.scheduler import Scheduler, SchedulerLimits, collect
from deltafind.engine.sequence import GenRequest
from tests.unit.test_speculative import (
    ALPHA,
    SAMPLES,
    _accept_everything,
    _drafting_prompt,
    _exact_joint,
    _Failing,
    _prompts,
    _sources,
    build_stores,
    chi2_pvalue,
)

ON = PolicyOptions(mode="on", max_width=5)


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Model]:
    out = build_stores(tmp_path_factory.mktemp("spec_sched"))
    yield out
    for m in out.values():
        m.close()


def _requests(model: Model) -> list[tuple[GenRequest, list[int]]]:
    """Requests with max-token and stop cuts, and what drafting-off `generate` makes of each."""
    out = []
    for i, prompt in enumerate(_prompts(8)):
        free = list(generate(model.net, prompt, SamplingParams(max_new_tokens=20), ()))
        if i % 3 == 0:
            params = SamplingParams(max_new_tokens=20, stop_token_ids=(free[5 + i],))
        else:
            params = SamplingParams(max_new_tokens=3 + 2 * i)
        out.append(
            (GenRequest(tuple(prompt), params), list(generate(model.net, prompt, params, ())))
        )
    return out


@pytest.mark.parametrize(
    ("target", "source_name"),
    [("moe", "ngram"), ("moe", "self2"), ("llama", "self1"), ("llama", "store")],
)
def test_concurrent_drafting_sequences_match_drafting_off(
    stores: dict[str, Model], target: str, source_name: str
) -> None:
    model = stores[target]
    reqs = _requests(model)
    sched = Scheduler(
        model.net,
        (),
        SchedulerLimits(max_running=4, max_step_tokens=12),
        draft=_sources(stores, target)[source_name],
        draft_policy=ON,
    )
    try:
        handles = [sched.submit(req) for req, _ in reqs]
        got = [collect(h, timeout=120) for h in handles]
    finally:
        sched.close()
    assert [t for t, _ in got] == [want for _, want in reqs]
    assert all(f.reason in ("stop", "length") for _, f in got)
    d = sched.stats.draft
    assert d.proposed > d.accepted > 0 and d.failures == 0
    assert sched.stats.max_batch > 1  # sequences shared steps


def test_eos_cut_inside_an_accepted_block(stores: dict[str, Model]) -> None:
    model = stores["moe"]
    prompt = _prompts(9)[8]
    free = list(generate(model.net, prompt, SamplingParams(max_new_tokens=24), ()))
    eos = free[10]
    want = free[: free.index(eos) + 1]
    sched = Scheduler(
        model.net, (eos,), SchedulerLimits(max_running=2), draft=NgramSource(), draft_policy=ON
    )
    try:
        tokens, fin = collect(
            sched.submit(GenRequest(tuple(prompt), SamplingParams(max_new_tokens=24))), timeout=60
        )
    finally:
        sched.close()
    assert tokens == want and fin.reason == "stop" and fin.completion_tokens == len(want)


def test_a_failing_draft_falls_back_in_the_scheduler(stores: dict[str, Model]) -> None:
    model = stores["moe"]
    reqs = _requests(model)[:4]
    sched = Scheduler(
        model.net,
        (),
        SchedulerLimits(max_running=4),
        draft=_Failing(1, torch.OutOfMemoryError("out of memory")),
        draft_policy=ON,
    )
    try:
        with capture_logs() as logs:
            got = [collect(sched.submit(req), timeout=60) for req, _ in reqs]
    finally:
        sched.close()
    assert [t for t, _ in got] == [w for _, w in reqs]
    # each request that got as far as a second proposal failed it, once, with a log line
    assert sum(e["event"] == "draft_failed" for e in logs) == sched.stats.draft.failures >= 2
    assert sched.stats.errors == 0


def test_a_failing_verify_pass_reruns_the_step_target_only(stores: dict[str, Model]) -> None:
    model = stores["moe"]

    class WideFails:
        """The real model, except that a pass returning several rows of one segment runs out of memory."""

        def __init__(self, net):
            self.net, self.num_layers, self.lm_head = net, net.num_layers, net.lm_head

        def parameters(self):
            return self.net.parameters()

        def __call__(self, ids, batch, all_logits=False):
            if any(r > 1 for r in batch.logit_rows):
                # fail part-way, as a real OOM would: some rows already appended
                for s in batch.segments:
                    s.cache.layers[0].append(
                        *[
                            t[:1].expand(s.num_tokens, *t.shape[1:]).clone()
                            for t in s.cache.layers[0].view()
                        ]
                    )
                raise torch.OutOfMemoryError("CUDA out of memory")
            return self.net(ids, batch, all_logits)

    reqs = _requests(model)[:3]
    sched = Scheduler(
        WideFails(model.net),
        (),
        SchedulerLimits(max_running=3),
        draft=NgramSource(),
        draft_policy=ON,
    )
    try:
        with capture_logs() as logs:
            got = [collect(sched.submit(req), timeout=60) for req, _ in reqs]
    finally:
        sched.close()
    assert [t for t, _ in got] == [w for _, w in reqs]
    assert all(f.reason in ("stop", "length") for _, f in got)
    assert any(e["event"] == "draft_failed" and e.get("during") == "verify" for e in logs)


def _scheduler_joint(model: Model, prompt: list[int], params: SamplingParams, source, exact: dict):
    sched = Scheduler(
        model.net,
        (),
        SchedulerLimits(max_running=16, max_queue=SAMPLES),
        draft=source,
        draft_policy=PolicyOptions(mode="on", max_width=2),
    )
    try:
        handles = [
            sched.submit(
                GenRequest(
                    tuple(prompt),
                    SamplingParams(
                        max_new_tokens=3,
                        temperature=params.temperature,
                        top_k=params.top_k,
                        seed=seed,
                    ),
                )
            )
            for seed in range(SAMPLES)
        ]
        outs = [tuple(collect(h, timeout=300)[0]) for h in handles]
    finally:
        sched.close()
    keys = list(exact)
    counts = torch.zeros(len(keys) + 1, dtype=torch.long)
    for out in outs:
        counts[keys.index(out) if out in exact else len(keys)] += 1
    return chi2_pvalue(counts, torch.tensor([*exact.values(), 0.0])), sched.stats.draft


def test_sampling_through_the_scheduler_keeps_the_target_distribution(
    stores: dict[str, Model], monkeypatch: pytest.MonkeyPatch
) -> None:
    """SAMPLES seeded requests, 16 at a time in shared steps: tokens 1-3 against the exact joint, at ALPHA."""
    from deltafind.engine import speculative

    model = stores["llama"]
    params = SamplingParams(temperature=1.0, top_k=3)
    source = _sources(stores, "llama")["ngram"]
    prompt = _drafting_prompt(model, source, params)
    exact = _exact_joint(model, prompt, params, 3)
    pvalue, drafts = _scheduler_joint(model, prompt, params, source, exact)
    assert pvalue > ALPHA
    assert drafts.proposed > drafts.accepted > 0  # drafts were both accepted and rejected
    monkeypatch.setattr(speculative, "accept", _accept_everything)
    assert (
        _scheduler_joint(model, prompt, params, source, exact)[0] < ALPHA
    )  # a broken rule fails it


def test_penalties_and_logprobs_with_drafts_equal_drafting_off(stores: dict[str, Model]) -> None:
    """Each verified row sees the penalties of the drafts before it; logprobs come from the target's rows."""
    model = stores["moe"]
    reqs = [
        GenRequest(
            tuple(p),
            SamplingParams(max_new_tokens=16),
            logprobs=2,
            presence_penalty=0.3 * (i % 2),
            frequency_penalty=0.5 * (i % 3 == 0),
        )
        for i, p in enumerate(_prompts(6))
    ]

    def events(draft):
        sched = Scheduler(
            model.net, (), SchedulerLimits(max_running=3), draft=draft, draft_policy=ON
        )
        try:
            handles = [sched.submit(r) for r in reqs]
            out = []
            for h in handles:
                evs = list(h)
                out.append([(e.token_id, e.logprob, tuple(t for t, _ in e.top)) for e in evs[:-1]])
            return out, sched.stats.draft
        finally:
            sched.close()

    want, _ = events(None)
    got, drafts = events(NgramSource())
    assert drafts.proposed > 0
    for w, g in zip(want, got, strict=True):
        assert [t for t, _, _ in g] == [t for t, _, _ in w]
        assert [top for _, _, top in g] == [top for _, _, top in w]
        assert [lp for _, lp, _ in g] == pytest.approx([lp for _, lp, _ in w], abs=1e-5)


def test_metrics_report_the_schedulers_draft_counters(stores: dict[str, Model]) -> None:
    from deltafind.server.metrics import ServerMetrics, render

    model = stores["moe"]
    sched = Scheduler(
        model.net, (), SchedulerLimits(max_running=2), draft=NgramSource(), draft_policy=ON
    )
    try:
        for req, _ in _requests(model)[:3]:
            collect(sched.submit(req), timeout=60)
        text = render(ServerMetrics().snapshot(), True, sched.snapshot())
    finally:
        sched.close()
    d = sched.stats.draft
    assert d.proposed > 0
    values = {}
    for line in text.splitlines():
        if line.startswith("deltafind_draft_tokens_total{"):
            labels, value = line.rsplit(" ", 1)
            values["proposed" if 'outcome="proposed"' in labels else "accepted"] = float(value)
            assert 'source="ngram"' in labels
    assert values == {"proposed": d.proposed, "accepted": d.accepted}
    assert "deltafind_draft_acceptance_ratio" in text and "deltafind_draft_saved_seconds" in text
