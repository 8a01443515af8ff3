"""The engine core stepped by hand (no threads), one sequence's failure kept to itself, and constraints.

References are independent of the core: a 20-line greedy loop over full recomputes
(`model.forward_logits`, no cache, no core) is the oracle for greedy output, with and
without a constraint; sampled constrained output is checked against the exact joint
distribution computed from those same logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltafind import Model
from deltafind.engine.constraint import apply
from deltafind.engine.core import EngineCore
from deltafind.engine.draft.base import Proposal
from deltafind.engine.draft.ngram import NgramSource
from deltafind.engine.draft.policy import DraftStats, PolicyOptions
from deltafind.engine.draft.self_draft import SelfDraftSource
from deltafind.engine.generate import generate
from deltafind.engine.sampler import SamplingParams, sampling_probs
from deltafind.engine.scheduler import Scheduler, collect
from deltafind.engine.sequence import FinishEvent, GenRequest, TokenEvent
from deltafind.engine.step import SchedulerLimits
from deltafind.importer.setup import setup_store
from tests.conftest import make_hf_checkpoint
from tests.unit.test_speculative import ALPHA, chi2_pvalue

ON = PolicyOptions(mode="on", max_width=4)
PROMPTS = [
    [11, 42, 7, 99, 3, 150, 8],
    [5, 6, 5, 6, 5, 6],
    [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
    [77, 78],
]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Model:
    root = tmp_path_factory.mktemp("core")
    ckpt = make_hf_checkpoint(
        "qwen3_moe", root / "hf", seed=3, num_hidden_layers=2, num_experts=8, num_experts_per_tok=2
    )
    setup_store(ckpt, root / "store", [root / "d0"], dense_slices=2, progress=False)
    m = Model.open(root / "store", prefetch=False)
    yield m
    m.close()


class Automaton:
    """An allowed-token automaton: ids below `limit`, alternating even and odd, never the same id twice
    in a row; done after `length` tokens."""

    def __init__(self, vocab: int, limit: int = 64, length: int = 9) -> None:
        self.vocab, self.limit, self.length, self.history = vocab, limit, length, []

    def allowed(self) -> torch.Tensor:
        mask = torch.zeros(self.vocab, dtype=torch.bool)
        mask[len(self.history) % 2 : self.limit : 2] = True
        if self.history:
            mask[self.history[-1]] = False
        return mask

    def advance(self, token: int) -> bool:
        if self.done or not bool(self.allowed()[token]):
            return False
        self.history.append(token)
        return True

    def rollback(self, n: int) -> None:
        del self.history[len(self.history) - n :]

    @property
    def done(self) -> bool:
        return len(self.history) >= self.length


def reference(
    model: Model, prompt: list[int], n: int, constraint: Automaton | None = None
) -> list[int]:
    """The oracle: greedy over full recomputes, masked by `constraint`, stopping when it is done."""
    out: list[int] = []
    while len(out) < n and not (constraint is not None and constraint.done):
        logits = apply(model.forward_logits([*prompt, *out])[-1], constraint)
        token = int(torch.argmax(logits))
        assert constraint is None or constraint.advance(token)
        out.append(token)
    return out


def test_the_core_steps_without_threads(model: Model) -> None:
    core = EngineCore(model.net, (), SchedulerLimits(max_running=2, max_step_tokens=8))
    for i, p in enumerate(PROMPTS[:3]):
        core.add(GenRequest(tuple(p), SamplingParams(max_new_tokens=4)), i)
    plan = core.schedule()
    assert [it.seq.seq_id for it in plan.items] == [0, 1] and [
        it.num_tokens for it in plan.items
    ] == [7, 1]  # chunked
    out = core.execute(plan)
    assert (
        out.logits.shape[0] == 2
    )  # one row per item: prompt 0's last token, and prompt 1's first chunk
    events = core.update(plan, out)
    assert (
        [(i, type(e)) for i, e in events] == [(0, TokenEvent)]
        and len(core.running) == 2
        and len(core.waiting) == 1
    )
    got: dict[int, list[int]] = {0: [events[0][1].token_id]}
    while core.has_work:
        for i, e in core.step():
            if isinstance(e, TokenEvent):
                got.setdefault(i, []).append(e.token_id)
            else:
                assert e.reason == "length"
    assert [got[i] for i in range(3)] == [reference(model, p, 4) for p in PROMPTS[:3]]


class Poison:
    """A constraint that breaks after two tokens, as a buggy grammar would."""

    def __init__(self, vocab: int) -> None:
        self.inner = Automaton(vocab, length=99)

    def allowed(self) -> torch.Tensor:
        if len(self.inner.history) >= 2:
            raise RuntimeError("grammar bug")
        return self.inner.allowed()

    def advance(self, token: int) -> bool:
        return self.inner.advance(token)

    def rollback(self, n: int) -> None:
        self.inner.rollback(n)

    done = False


@pytest.mark.parametrize("draft", [None, "ngram"])
@pytest.mark.parametrize(
    "poison", ["constraint", "forbids_everything", "constraint_factory", "subnormal_sampling"]
)
def test_three_greedy_streams_plus_one_poisoned_request_give_the_same_three_outputs(
    model: Model, poison: str, draft
) -> None:
    vocab = model.net.lm_head.weight.shape[0]
    nothing = type(
        "Nothing", (Automaton,), {"allowed": lambda self: torch.zeros(self.vocab, dtype=torch.bool)}
    )
    bad = {
        "constraint": GenRequest(
            (9, 8, 7), SamplingParams(max_new_tokens=12), constraint=lambda: Poison(vocab)
        ),
        "forbids_everything": GenRequest(
            (9, 8, 7), SamplingParams(max_new_tokens=12), constraint=lambda: nothing(vocab)
        ),
        "constraint_factory": GenRequest(
            (9, 8, 7), SamplingParams(max_new_tokens=12), constraint=lambda: 1 / 0
        ),
        "subnormal_sampling": GenRequest(
            (9, 8, 7), SamplingParams(max_new_tokens=12, temperature=1e-320, top_p=1e-300, seed=1)
        ),
    }[poison]
    good = [GenRequest(tuple(p), SamplingParams(max_new_tokens=12)) for p in PROMPTS[:3]]

    def run(reqs: list[GenRequest]) -> list[tuple[list[int], FinishEvent]]:
        sched = Scheduler(
            model.net,
            (),
            SchedulerLimits(max_running=4, max_step_tokens=6),
            draft=NgramSource() if draft else None,
            draft_policy=ON,
        )
        try:
            handles = [sched.submit(r) for r in reqs]
            return [collect(h, timeout=120) for h in handles]
        finally:
            sched.close()

    alone = run(good)
    poisoned = run([good[0], bad, good[1], good[2]])
    assert (
        [t for t, _ in alone]
        == [t for t, _ in poisoned[:1] + poisoned[2:]]
        == [reference(model, p, 12) for p in PROMPTS[:3]]
    )
    assert all(f.reason == "length" for _, f in poisoned[:1] + poisoned[2:])
    tokens, fin = poisoned[1]
    if poison == "subnormal_sampling":  # valid input: sampled, near-greedy, no error
        assert fin.reason == "length" and tokens == reference(model, [9, 8, 7], 12)
    else:
        assert fin.reason == "error" and fin.error, fin


@pytest.mark.parametrize("draft", [None, "ngram", "self1"])
def test_greedy_constrained_output_equals_constrained_decoding_without_drafts(
    model: Model, draft
) -> None:
    vocab = model.net.lm_head.weight.shape[0]
    source = {None: None, "ngram": NgramSource(), "self1": SelfDraftSource(model.net, 1)}[draft]
    stats = DraftStats()
    for prompt in [[2, 5, 2, 5, 2, 5, 2], *PROMPTS]:
        want = reference(model, prompt, 20, Automaton(vocab))
        req = GenRequest(
            tuple(prompt), SamplingParams(max_new_tokens=20), constraint=lambda: Automaton(vocab)
        )
        got = list(
            generate(
                model.net,
                prompt,
                req.params,
                (),
                draft=source,
                draft_policy=ON,
                draft_stats=stats,
                request=req,
            )
        )
        assert got == want and len(got) == 9, (
            draft,
            prompt,
        )  # ends with "stop" when the automaton is done
        check = Automaton(vocab)
        assert all(check.advance(t) for t in got)
    if source is not None:
        assert (
            stats.proposed > stats.accepted > 0
        )  # drafts were accepted, and rejected (by the target or the mask)


def _exact_joint(
    model: Model, prompt: list[int], params: SamplingParams, vocab: int, depth: int
) -> dict[tuple[int, ...], float]:
    out: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(depth):
        nxt = {}
        for prefix, pr in out.items():
            c = Automaton(vocab)
            assert all(c.advance(t) for t in prefix)
            p = sampling_probs(apply(model.forward_logits([*prompt, *prefix])[-1], c), params)
            for t in torch.nonzero(p).flatten().tolist():
                nxt[(*prefix, t)] = pr * float(p[t])
        out = nxt
    return out


class Oracle:
    """A deterministic draft (q None) that proposes constrained greedy decoding's tokens: under sampling
    the verifier accepts them often, not always."""

    name, capture_layers = "oracle", ()

    def __init__(self, model: Model, prompt_len: int) -> None:
        self.model, self.n = model, prompt_len

    def session(self, prompt_ids):
        src = self

        class Session:
            def propose(self, history, width, params, generator):
                c = Automaton(src.model.net.lm_head.weight.shape[0])
                assert all(c.advance(t) for t in history[src.n :])
                return Proposal(reference(src.model, list(history), width, c))

            def commit(self, history, captured):
                pass

            def close(self):
                pass

        return Session()

    def close(self) -> None:
        pass


@pytest.mark.parametrize("draft", [None, "self1", "oracle"])
def test_sampled_constrained_output_follows_the_masked_distribution(model: Model, draft) -> None:
    vocab = model.net.lm_head.weight.shape[0]
    prompt = [2, 5, 2, 5, 2, 5, 2]
    params = SamplingParams(temperature=1.0, top_k=3)
    exact = _exact_joint(model, prompt, params, vocab, 3)
    keys = list(exact)
    counts = torch.zeros(len(keys) + 1, dtype=torch.long)
    stats = DraftStats()
    source = {
        None: None,
        "self1": SelfDraftSource(model.net, 1),
        "oracle": Oracle(model, len(prompt)),
    }[draft]
    for seed in range(600):
        req = GenRequest(
            tuple(prompt),
            SamplingParams(max_new_tokens=3, temperature=1.0, top_k=3, seed=seed),
            constraint=lambda: Automaton(vocab),
        )
        got = tuple(
            generate(
                model.net,
                prompt,
                req.params,
                (),
                draft=source,
                draft_policy=ON,
                draft_stats=stats,
                request=req,
            )
        )
        counts[keys.index(got) if got in exact else len(keys)] += 1
    assert chi2_pvalue(counts, torch.tensor([*exact.values(), 0.0])) > ALPHA
    # its unconstrained drafts are mostly forbidden by the mask, hence rejected
    if draft == "self1":
        assert stats.proposed > stats.accepted
    if draft == "oracle":
        assert stats.proposed > stats.accepted > 0


def test_generate_raises_the_sequences_own_error(model: Model, tmp_path: Path) -> None:
    req = GenRequest((1, 2), SamplingParams(max_new_tokens=4), constraint=lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        list(generate(model.net, (), req.params, request=req))
