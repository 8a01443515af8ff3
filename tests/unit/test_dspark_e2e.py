"""DSpark drafting for Kimi K3 through the one verifier, on a tiny synthetic K3 store with a
synthetic DSpark: greedy output with drafting equals drafting off token for token; a DSpark
made to propose the target's own continuation gets multi-token blocks accepted; the
context it keeps is exactly the target's rows for the committed positions."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from deltafind import Model
from deltafind.engine.draft.dspark import DSparkSession, DSparkSource
from deltafind.engine.draft.policy import DraftStats, PolicyOptions
from deltafind.engine.generate import generate
from deltafind.engine.sampler import SamplingParams
from deltafind.engine.speculative import captured_rows
from deltafind.importer.dspark_import import write_synthetic_dspark
from deltafind.importer.setup import setup_store
from deltafind.importer.synthetic import open_synthetic
from deltafind.models import dspark, kimi_k3
from deltafind.models.ops.batch import Batch, SequenceCache

PROMPTS = [
    [5, 77, 300, 12, 480, 9, 101, 33, 250, 7, 64, 2],
    [400, 3],
    [9],
    [17, 17, 17, 17, 200, 201, 202, 17],
]
ON = PolicyOptions(mode="on")  # draft every step, so every width and cut is exercised


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("k3e2e")
    store = root / "store"
    setup_store(
        open_synthetic("kimi_k3", "tiny", seed=3),
        store,
        [root / "d0"],
        dense_slices=2,
        progress=False,
        names=kimi_k3.WEIGHTS,
    )
    write_synthetic_dspark(store, seed=1)
    m = Model.open(store, expert_bytes=None, prefetch=False)
    yield m
    m.close()


class Recording:
    """The real source, keeping its sessions so a test can look at their contexts."""

    def __init__(self, source: DSparkSource) -> None:
        self.source, self.sessions = source, []
        self.name, self.capture_layers = source.name, source.capture_layers

    def session(self, prompt_ids: Sequence[int]) -> DSparkSession:
        s = self.source.session(prompt_ids)
        s.close = lambda: None  # keep the context for inspection
        self.sessions.append(s)
        return s

    def close(self) -> None:
        self.source.close()


def _plain(m: Model, prompt: list[int], n: int) -> list[int]:
    return list(generate(m.net, prompt, SamplingParams(max_new_tokens=n), m.eos_token_ids))


def _drafted(
    m: Model, prompt: list[int], n: int, source, stats: DraftStats | None = None
) -> list[int]:
    return list(
        generate(
            m.net,
            prompt,
            SamplingParams(max_new_tokens=n),
            m.eos_token_ids,
            draft=source,
            draft_policy=ON,
            draft_stats=stats,
        )
    )


def _oracle(m: Model, source: DSparkSource, continuation: list[int], rank: int = 64) -> None:
    """Make the DSpark propose `continuation`'s successor of each token: its hidden rows are
    zeroed by the final norm (K3's head then scores nothing) and the Markov head holds the
    bigram table one-hot (next(t) = the token after t's first occurrence)."""
    model, vocab, h = source.model, m.net.args.vocab_size, m.net.args.hidden_size
    succ: dict[int, int] = {}
    for a, b in itertools.pairwise(continuation):
        succ.setdefault(a, b)
    slots = {t: i for i, t in enumerate(dict.fromkeys(succ.values()))}
    assert len(slots) <= rank
    w1, w2 = torch.zeros(vocab, rank), torch.zeros(vocab, rank)
    for t, i in slots.items():
        w2[t, i] = 1.0
    for a, b in succ.items():
        w1[a, slots[b]] = 10.0
    model.markov_head = dspark.MarkovHead(vocab, rank).to(torch.bfloat16)
    model.markov_head.markov_w1.weight.data, model.markov_head.markov_w2.weight.data = (
        w1.bfloat16(),
        w2.bfloat16(),
    )
    model.confidence_head = dspark.ConfidenceHead(h, rank).to(torch.bfloat16)
    with torch.no_grad():
        model.final_norm.weight.zero_()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_output_with_dspark_equals_drafting_off(model: Model, prompt: list[int]) -> None:
    source = DSparkSource.open(model.store_dir, model.net)
    for n in (1, 2, 7, 19):  # max-token boundaries inside and at the end of a block
        assert _drafted(model, prompt, n, source) == _plain(model, prompt, n), n


def test_accepted_blocks_and_the_context_it_keeps(model: Model) -> None:
    prompt, n = PROMPTS[0], 40
    want = _plain(model, prompt, n)
    source = DSparkSource.open(model.store_dir, model.net)
    _oracle(model, source, [prompt[-1], *want])
    rec, stats = Recording(source), DraftStats()
    got = _drafted(model, prompt, n, rec, stats)
    assert got == want
    # Blocks of more than one token were accepted (more accepted drafts than verify passes).
    assert stats.accepted > stats.steps > 0 and max(stats.widths) == dspark.BLOCK, stats.as_dict()
    assert stats.accepted < stats.proposed  # and some were rejected, so rollback ran too
    # The context holds one row per committed position: the target's rows for history[:-1],
    # which a single pass over that history recomputes (up to the bf16 rounding of the rows).
    (session,) = rec.sessions
    history = [*prompt, *want]
    ctx = session.ctx
    assert ctx is not None
    committed = len(history) - 1  # the last emitted token was never run
    assert ctx.length == committed
    cache = SequenceCache(model.net.num_layers)
    batch = Batch.of([(cache, committed)])
    batch.capture = source.capture_layers
    with torch.inference_mode():
        model.net(torch.tensor(history[:committed]), batch)
        fresh = source.model.new_context()
        source.model.extend(fresh, captured_rows(batch, source.capture_layers, slice(0, committed)))
    for mine, ref in zip(ctx.layers, fresh.layers, strict=True):
        for a, b in zip(mine.view(), ref.view(), strict=True):
            torch.testing.assert_close(a.float(), b.float(), atol=3e-2, rtol=2e-2)


def test_context_limit_hands_over_to_the_target(model: Model) -> None:
    prompt, n = PROMPTS[0], 20
    want = _plain(model, prompt, n)
    source = DSparkSource.open(model.store_dir, model.net, max_context=len(prompt) + 5)
    _oracle(model, source, [prompt[-1], *want])
    rec, stats = Recording(source), DraftStats()
    assert _drafted(model, prompt, n, rec, stats) == want
    assert rec.sessions[0].stopped and 0 < stats.emitted <= 5 + dspark.BLOCK + 1
    assert stats.failures == 0


def test_dspark_source_refuses_another_target(model: Model, tmp_path: Path) -> None:
    source = DSparkSource.open(model.store_dir, model.net)
    other = open_synthetic("llama", "tiny", seed=1)
    setup_store(other, tmp_path / "llama", dense_slices=2, progress=False)
    llama = Model.open(tmp_path / "llama")
    try:
        from deltafind.engine.draft.base import DraftError

        with pytest.raises(DraftError, match="only for Kimi K3"):
            source.check_target(llama.net)
    finally:
        llama.close()


def test_concurrent_dspark_sequences_in_the_scheduler(model: Model) -> None:
    """Sequences share target steps (each with its own DSpark context and KDA rows); prompts are
    prefilled in chunks; output equals drafting off and blocks are accepted."""
    from deltafind.engine.scheduler import Scheduler, SchedulerLimits, collect
    from deltafind.engine.sequence import GenRequest

    reqs = [
        (
            GenRequest(tuple(p), SamplingParams(max_new_tokens=6 + 7 * i)),
            _plain(model, p, 6 + 7 * i),
        )
        for i, p in enumerate(PROMPTS)
    ]
    source = DSparkSource.open(model.store_dir, model.net)
    _oracle(model, source, [t for (req, want) in reqs for t in (req.prompt_ids[-1], *want)])
    sched = Scheduler(
        model.net,
        tuple(model.eos_token_ids),
        SchedulerLimits(max_running=4, max_step_tokens=10),
        draft=source,
        draft_policy=ON,
    )
    try:
        got = [collect(h, timeout=120) for h in [sched.submit(req) for req, _ in reqs]]
    finally:
        sched.close()
    assert [t for t, _ in got] == [want for _, want in reqs]
    d = sched.stats.draft
    assert d.accepted > d.steps > 0 and d.failures == 0 and sched.stats.max_batch > 1, d.as_dict()


def test_draft_dspark_through_the_python_api(model: Model) -> None:
    """`draft="dspark"` (engine/draft/load.py) opens <store>/draft/dspark for this K3."""
    ids = PROMPTS[0]
    off = model.generate(ids, max_new_tokens=9, draft="off")
    assert model.generate(ids, max_new_tokens=9, draft="dspark") == off
    assert model.last_draft_stats.source == "dspark" and model.last_draft_stats.proposed > 0


def test_sampling_with_dspark_keeps_going_and_a_desync_is_refused(model: Model) -> None:
    """Under sampling DSpark's proposal is deterministic (q None): a seeded run repeats and
    nothing fails (the distribution test is the verifier's). A session whose
    context does not match the committed positions refuses to propose (the verifier then
    decodes target-only)."""
    from deltafind.engine.draft.base import DraftError

    source = DSparkSource.open(model.store_dir, model.net)
    params = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.95, seed=7)
    stats = DraftStats()
    out = list(
        generate(
            model.net,
            PROMPTS[0],
            params,
            model.eos_token_ids,
            draft=source,
            draft_policy=ON,
            draft_stats=stats,
        )
    )
    again = list(
        generate(model.net, PROMPTS[0], params, model.eos_token_ids, draft=source, draft_policy=ON)
    )
    assert len(out) == 12 and out == again and stats.failures == 0 and stats.proposed > 0
    session = source.session(PROMPTS[0])
    with pytest.raises(DraftError, match="holds 0 rows but the target committed 12"):
        session.propose([*PROMPTS[0], 1], 3, params, None)
    with pytest.raises(DraftError, match="captured rows"):
        session.commit([*PROMPTS[0], 1], None)
