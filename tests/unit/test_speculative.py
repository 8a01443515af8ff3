"""The verifier never changes output: greedy token for token, sampling in distribution.

Greedy runs compare drafting on with drafting off on tiny stores of real
families (through `setup`), for every draft source owned here, across EOS,
stop ids and max-token cuts. Sampling tests are chi-square goodness-of-fit
tests against the exact target distribution (computed from the target's own
logits), at significance level ALPHA; each also shows that a broken
acceptance rule (accept every draft) fails the same test.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from deltafind import Model
from deltafind.engine import speculative
from deltafind.engine.draft.base import DraftError, Proposal
from deltafind.engine.draft.ngram import NgramSource
from deltafind.engine.draft.policy import DraftStats, PolicyOptions
from deltafind.engine.draft.self_draft import SelfDraftSource
from deltafind.engine.draft.store_draft import StoreDraftSource
from deltafind.engine.generate import generate
from deltafind.engine.sampler import SamplingParams, sampling_probs
from deltafind.importer.setup import setup_store
from tests.conftest import make_hf_checkpoint

ALPHA = 1e-3  # significance level of every chi-square test here


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """P-value of Pearson's chi-square goodness of fit (cells with expected < 5 pooled)."""
    n = float(counts.sum())
    exp = probs.double() * n
    obs = counts.double()
    small = exp < 5
    if small.any():
        exp = torch.cat([exp[~small], exp[small].sum().view(1)])
        obs = torch.cat([obs[~small], obs[small].sum().view(1)])
    keep = exp > 0
    if bool((obs[~keep] > 0).any()):
        return 0.0  # an outcome of probability zero happened
    exp, obs = exp[keep], obs[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = exp.numel() - 1
    return float(
        torch.special.gammaincc(
            torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)
        )
    )


# -- the acceptance rule alone --------------------------------------------------


def _exact_cells(p0: torch.Tensor, p1: torch.Tensor, q0: torch.Tensor) -> torch.Tensor:
    """Exact distribution over the outcomes of one verify pass of drafts (d1, d2), d1 ~ q0.

    Cell x < V: the first emitted token is x and came from the residual (nothing follows
    from this pass); cell V + x*V + y: x was the accepted draft, then y was emitted.
    Rejection sampling accepts x with probability min(p0(x), q0(x)), and whatever
    follows an accepted draft is distributed as row 1's p1; the first token's marginal is p0.
    """
    both = torch.minimum(p0, q0).double()
    return torch.cat([p0.double() - both, (both[:, None] * p1.double()[None, :]).flatten()])


def _count(rule, logits, q, fixed: list[int] | None, params, n: int, seed: int) -> torch.Tensor:
    v = logits.shape[1]
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(v + v * v, dtype=torch.long)
    for _ in range(n):
        tokens = (
            fixed
            if fixed is not None
            else [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]
        )
        out = rule(logits, tokens, q, params, gen)
        counts[out[0] if out[0] != tokens[0] else v + out[0] * v + out[1]] += 1
    return counts


def _accept_everything(logits, tokens, q, params, generator):
    """A broken rule: every draft accepted, then the target's own token."""
    return [
        *tokens,
        int(torch.multinomial(sampling_probs(logits[len(tokens)], params), 1, generator=generator)),
    ]


@pytest.mark.parametrize("with_q", [False, True], ids=["deterministic", "with-q"])
def test_rejection_sampling_keeps_the_target_distribution(with_q: bool) -> None:
    torch.manual_seed(3)
    v, n = 6, 8_000  # 8,000 seeded verify passes per case
    logits = torch.randn(3, v) * 1.5  # rows for [pending, d1, d2]
    params = SamplingParams(temperature=0.9, top_k=5)
    p0, p1 = sampling_probs(logits[0], params), sampling_probs(logits[1], params)
    if with_q:  # a draft distribution unlike p (drafts are drawn from it)
        q, fixed = torch.softmax(torch.randn(2, v), -1), None
        q0 = q[0]
    else:  # deterministic drafts: a likely but not the likeliest token, so both branches happen often
        q, fixed = None, [int(torch.argsort(p0)[-2]), int(torch.argmax(p1))]
        q0 = torch.nn.functional.one_hot(torch.tensor(fixed[0]), v).float()
    exact = _exact_cells(p0, p1, q0)
    got = _count(speculative.accept, logits, q, fixed, params, n, seed=1)
    assert chi2_pvalue(got, exact) > ALPHA
    first = torch.zeros(v, dtype=torch.long)  # the first emitted token's marginal alone is p0
    for cell, c in enumerate(got.tolist()):
        first[cell if cell < v else (cell - v) // v] += c
    assert chi2_pvalue(first, p0) > ALPHA
    broken = _count(_accept_everything, logits, q, fixed, params, n, seed=1)
    assert chi2_pvalue(broken, exact) < ALPHA  # the test can tell a wrong rule


def test_greedy_accepts_the_longest_matching_prefix_plus_the_targets_token() -> None:
    logits = torch.full((4, 5), -1.0)
    for row, best in enumerate([2, 4, 1, 3]):
        logits[row, best] = 1.0
    g = SamplingParams()
    assert speculative.accept(logits, [2, 4, 1], None, g, None) == [2, 4, 1, 3]
    assert speculative.accept(logits, [2, 0, 1], None, g, None) == [2, 4]
    assert speculative.accept(logits, [3, 4, 1], None, g, None) == [2]
    assert speculative.accept(logits[:1], [], None, g, None) == [2]


# -- whole generations on tiny stores -------------------------------------------


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Model]:
    out = build_stores(tmp_path_factory.mktemp("spec"))
    yield out
    for m in out.values():
        m.close()


def build_stores(root: Path) -> dict[str, Model]:
    """Tiny stores through `setup`: a MoE and a dense target, and a small dense draft."""
    out = {}
    # "small" is "llama" with its last layer cut off (same seed, tied head): a same-vocabulary draft that is
    # sometimes right, as a small sibling model is; for "moe" it is an unrelated draft, almost always wrong.
    for name, family, seed, extra in [
        ("moe", "qwen3_moe", 3, {"num_hidden_layers": 3}),
        ("llama", "llama", 5, {"num_hidden_layers": 3, "tie_word_embeddings": True}),
        ("small", "llama", 5, {"num_hidden_layers": 2, "tie_word_embeddings": True}),
    ]:
        ckpt = make_hf_checkpoint(family, root / name / "hf", seed=seed, **extra)
        setup_store(
            ckpt, root / name / "store", [root / name / "d0"], dense_slices=2, progress=False
        )
        out[name] = Model.open(root / name / "store", prefetch=False)
    return out


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(n):
        base = torch.randint(0, 256, (3 + i % 5,), generator=g).tolist()
        out.append(base * (1 + i % 3) + torch.randint(0, 256, (i % 4,), generator=g).tolist())
    return out


def _sources(stores: dict[str, Model], target: str) -> dict[str, object]:
    net = stores[target].net
    vocab = net.lm_head.weight.shape[0]
    return {
        "ngram": NgramSource(),
        "self1": SelfDraftSource(net, 1),
        "self2": SelfDraftSource(net, 2),
        "store": StoreDraftSource(stores["small"].net, "store:small", vocab),
    }


@pytest.mark.parametrize("target", ["moe", "llama"])
def test_greedy_output_with_every_source_equals_drafting_off(
    stores: dict[str, Model], target: str
) -> None:
    model = stores[target]
    total = DraftStats()
    for name, source in _sources(stores, target).items():
        for prompt in _prompts(5):
            params = SamplingParams(max_new_tokens=24)
            want = list(generate(model.net, prompt, params, ()))
            for mode in ("on", "auto"):
                st = DraftStats()
                got = list(
                    generate(
                        model.net,
                        prompt,
                        params,
                        (),
                        draft=source,
                        draft_policy=PolicyOptions(mode=mode, max_width=5),
                        draft_stats=st,
                    )
                )
                assert got == want, (name, mode, prompt)
                total.add(st)
    # the runs exercised both acceptance and rejection
    assert total.proposed > total.accepted > 0


@pytest.mark.parametrize("source_name", ["ngram", "self1", "store"])
def test_stop_ids_eos_and_max_tokens_cut_exactly_as_without_drafts(
    stores: dict[str, Model], source_name: str
) -> None:
    model = stores["moe"]
    source = _sources(stores, "moe")[source_name]
    on = PolicyOptions(mode="on", max_width=6)
    for prompt in _prompts(6)[::2]:
        free = list(generate(model.net, prompt, SamplingParams(max_new_tokens=30), ()))
        for cut in (1, 2, 7, 30):
            p = SamplingParams(max_new_tokens=cut)
            assert (
                list(generate(model.net, prompt, p, (), draft=source, draft_policy=on))
                == free[:cut]
            )
        for j in (1, 4, 17):  # stop at the first occurrence of the token emitted j-th
            stop = free[j]
            want = free[: free.index(stop) + 1]
            p = SamplingParams(max_new_tokens=30, stop_token_ids=(stop,))
            assert list(generate(model.net, prompt, p, (), draft=source, draft_policy=on)) == want
            p = SamplingParams(max_new_tokens=30)
            assert (
                list(generate(model.net, prompt, p, (stop,), draft=source, draft_policy=on)) == want
            )  # as EOS
            p = SamplingParams(max_new_tokens=30, ignore_eos=True)
            assert (
                list(generate(model.net, prompt, p, (stop,), draft=source, draft_policy=on)) == free
            )


class _Failing:
    """A draft source that breaks after `after` proposals, as an out-of-memory would."""

    name = "failing"
    capture_layers: tuple[int, ...] = ()

    def __init__(self, after: int, error: Exception) -> None:
        self.after, self.error = after, error

    def session(self, prompt_ids):
        source = self

        class S:
            n = 0

            def propose(self, history, width, params, generator):
                self.n += 1
                if self.n > source.after:
                    raise source.error
                return Proposal([int(history[-1])] * width)

            def commit(self, history, captured):
                pass

            def close(self):
                pass

        return S()

    def close(self):
        pass


@pytest.mark.parametrize(
    "error",
    [torch.OutOfMemoryError("CUDA out of memory"), DraftError("bad draft"), ValueError("bug")],
    ids=["oom", "draft", "bug"],
)
def test_a_failing_draft_falls_back_to_target_only_with_a_log_line(
    stores: dict[str, Model], error: Exception
) -> None:
    model = stores["moe"]
    prompt = _prompts(3)[2]
    params = SamplingParams(max_new_tokens=20)
    want = list(generate(model.net, prompt, params, ()))
    st = DraftStats()
    with capture_logs() as logs:
        got = list(
            generate(
                model.net,
                prompt,
                params,
                (),
                draft=_Failing(2, error),
                draft_policy=PolicyOptions(mode="on"),
                draft_stats=st,
            )
        )
    assert got == want
    assert st.failures == 1
    lines = [e for e in logs if e["event"] == "draft_failed"]
    assert (
        len(lines) == 1
        and lines[0]["fallback"] == "target_only"
        and type(error).__name__ in lines[0]["error"]
    )


def test_a_proposal_outside_the_vocabulary_is_refused_not_run(stores: dict[str, Model]) -> None:
    class Wild(_Failing):
        def session(self, prompt_ids):
            s = super().session(prompt_ids)
            s.propose = lambda history, width, params, generator: Proposal([10**6])
            return s

    model = stores["moe"]
    params = SamplingParams(max_new_tokens=8)
    st = DraftStats()
    with capture_logs() as logs:
        got = list(
            generate(
                model.net,
                [1, 2, 3],
                params,
                (),
                draft=Wild(0, ValueError()),
                draft_policy=PolicyOptions(mode="on"),
                draft_stats=st,
            )
        )
    assert got == list(generate(model.net, [1, 2, 3], params, ()))
    assert [e["event"] for e in logs].count("draft_failed") == 1


def test_self_draft_leaves_the_target_cache_as_a_plain_run_would(stores: dict[str, Model]) -> None:
    from deltafind.models.ops.batch import SequenceCache, forward_step

    net = stores["llama"].net
    prompt = _prompts(4)[3]
    cache = SequenceCache(net.num_layers)
    with torch.inference_mode():
        forward_step(net, cache, prompt)
        session = SelfDraftSource(net, 2).session(prompt)
        session.use_target_cache(cache)
        before = [layer.length for layer in cache.layers]
        prop = session.propose([*prompt, 5], 4, SamplingParams(), None)
        assert len(prop.tokens) == 4 and prop.q is None
        assert [layer.length for layer in cache.layers] == before and cache.length == len(prompt)
        # a verify pass over the rows the draft wrote gives the logits of a fresh full run
        got = forward_step(net, cache, [5, *prop.tokens], all_logits=True)
        ref = forward_step(
            net, SequenceCache(net.num_layers), [*prompt, 5, *prop.tokens], all_logits=True
        )[len(prompt) :]
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_store_draft_refuses_a_smaller_vocabulary(stores: dict[str, Model]) -> None:
    with pytest.raises(DraftError, match="vocabulary"):
        StoreDraftSource(stores["small"].net, "store:x", 10**6)


# -- sampling through whole generations -------------------------------------------

SAMPLES = 800  # seeded generations per case in the sampling tests below


def _exact_joint(
    model: Model, prompt: list[int], params: SamplingParams, depth: int
) -> dict[tuple[int, ...], float]:
    """P(first `depth` tokens) under `params`, from the target's logits by full recompute."""
    out: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(depth):
        nxt = {}
        for prefix, pr in out.items():
            p = sampling_probs(model.forward_logits([*prompt, *prefix])[-1], params)
            for t in torch.nonzero(p).flatten().tolist():
                nxt[(*prefix, t)] = pr * float(p[t])
        out = nxt
    return out


def _sample_joint(
    model: Model, prompt: list[int], params: SamplingParams, source, exact: dict, n: int
) -> float:
    keys = list(exact)
    counts = torch.zeros(
        len(keys) + 1, dtype=torch.long
    )  # the last cell: an outcome of probability zero
    on = PolicyOptions(mode="on", max_width=2)
    for seed in range(n):
        p = SamplingParams(
            max_new_tokens=3, temperature=params.temperature, top_k=params.top_k, seed=seed
        )
        got = tuple(generate(model.net, prompt, p, (), draft=source, draft_policy=on))
        counts[keys.index(got) if got in exact else len(keys)] += 1
    return chi2_pvalue(counts, torch.tensor([*exact.values(), 0.0]))


def _drafting_prompt(model: Model, source, params: SamplingParams) -> list[int]:
    """A prompt (some context plus the target's own greedy continuation of it, so the n-gram
    draft finds matches) under which the first 20 seeded runs both accept and reject drafts."""
    for base in _prompts(10):
        prompt = [*base, *generate(model.net, base, SamplingParams(max_new_tokens=12), ())]
        st = DraftStats()
        for seed in range(20):
            p = SamplingParams(
                max_new_tokens=3, temperature=params.temperature, top_k=params.top_k, seed=seed
            )
            list(
                generate(
                    model.net,
                    prompt,
                    p,
                    (),
                    draft=source,
                    draft_policy=PolicyOptions(mode="on"),
                    draft_stats=st,
                )
            )
        if st.proposed > st.accepted > 0:
            return prompt
    raise AssertionError("no prompt makes the draft both right and wrong")


@pytest.mark.parametrize("source_name", ["ngram", "self1"])
def test_sampled_tokens_follow_the_target_distribution_with_drafts(
    stores: dict[str, Model], source_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tokens 1-3 (token 2 is the first a verify pass decides, token 3 the one after an accepted
    draft): chi-square of SAMPLES seeded runs against the exact joint, at ALPHA."""
    model = stores["llama"]
    params = SamplingParams(temperature=1.0, top_k=3)
    source = _sources(stores, "llama")[source_name]
    prompt = _drafting_prompt(
        model, source, params
    )  # the runs draft; drafts are both accepted and rejected
    exact = _exact_joint(model, prompt, params, 3)
    assert _sample_joint(model, prompt, params, source, exact, SAMPLES) > ALPHA
    monkeypatch.setattr(speculative, "accept", _accept_everything)
    assert (
        _sample_joint(model, prompt, params, source, exact, SAMPLES) < ALPHA
    )  # a broken rule fails it
