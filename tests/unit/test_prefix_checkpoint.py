"""Prefix-cache checkpoints where a chat's history ends, retries, edits and respelled answers.

K3 renders tool_choice / response_format as a system message after the history, so the
next turn's prompt leaves the cached prompt + answer right where the history ended; KDA
state resumes only at a stored point. A request's `checkpoint` ends a prefill chunk there
and stores a copy of the cache. Checked on a synthetic K3 store (KDA + MLA) and on a
non-recurrent family (qwen3_moe): the next turn resumes from the checkpoint and its logits
equal, bit for bit, the model run directly with the same chunk boundaries and no cache
reuse (a run in one chunk rounds differently, so against that the tokens agree); the
checkpoint costs no expert read beyond the split chunk's; it is bounded in bytes and, where
one is kept, the finished sequence is not (no next turn extends it; it would push the checkpoint out).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from deltafind import Model
from deltafind.engine.core import EngineCore
from deltafind.engine.prefix_cache import cache_nbytes
from deltafind.engine.sampler import SamplingParams
from deltafind.engine.sequence import FinishEvent, GenRequest, TokenEvent
from deltafind.engine.step import SchedulerLimits
from deltafind.errors import RequestError
from deltafind.importer.setup import setup_store
from deltafind.importer.synthetic import open_synthetic
from deltafind.models import kimi_k3
from deltafind.models.ops.batch import SequenceCache, forward_step
from tests.conftest import make_hf_checkpoint

HISTORY = [(i * 37 + 5) % 240 + 3 for i in range(23)]  # system + user turns
TAIL = [201, 17, 99, 4, 150, 8]  # the per-request system message and the generation prompt
NEW = [61, 7, 230, 45, 12]  # the next turn's tool result / user message
MAX_NEW, TOP = 5, 8


@pytest.fixture(scope="module", params=["kimi_k3", "qwen3_moe"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp(request.param)
    if request.param == "kimi_k3":
        setup_store(
            open_synthetic("kimi_k3", "tiny", seed=3),
            root / "store",
            [root / "d0"],
            dense_slices=2,
            progress=False,
            names=kimi_k3.WEIGHTS,
        )
    else:
        ckpt = make_hf_checkpoint(
            "qwen3_moe",
            Path(root) / "hf",
            num_hidden_layers=2,
            num_experts=8,
            num_experts_per_tok=2,
        )
        setup_store(ckpt, root / "store", [root / "d0"], dense_slices=2, progress=False)
    m = Model.open(root / "store", expert_bytes=0, prefetch=False)  # every expert use is a read
    yield m
    m.close()


def _run(core: EngineCore, req: GenRequest) -> tuple[list[TokenEvent], FinishEvent]:
    core.add(req, 0)
    events: list[TokenEvent] = []
    while core.has_work:
        for _, e in core.step():
            if isinstance(e, FinishEvent):
                assert e.reason == "length", e.error
                return events, e
            events.append(e)
    raise AssertionError("no finish event")


def _request(prompt: list[int], checkpoint: int) -> GenRequest:
    return GenRequest(
        tuple(prompt),
        SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True),
        logprobs=TOP,
        checkpoint=checkpoint,
    )


def _reference(net: torch.nn.Module, chunks: list[list[int]]) -> list[TokenEvent]:
    """Greedy decode run straight on the model: the prompt fed in `chunks`, a fresh cache, no engine."""
    cache = SequenceCache(net.num_layers)
    with torch.inference_mode():
        for ids in chunks:
            logits = forward_step(net, cache, ids)[-1]
        out = []
        for i in range(MAX_NEW):
            lp = torch.log_softmax(logits.float(), dim=-1)
            vals, idx = torch.topk(lp, TOP)
            token = int(torch.argmax(logits.float()))
            out.append(
                TokenEvent(
                    token, float(lp[token]), tuple(zip(idx.tolist(), vals.tolist(), strict=True))
                )
            )
            if i + 1 < MAX_NEW:  # the last token is sampled, never run
                logits = forward_step(net, cache, [token])[-1]
    return out


def _chunks(prompt: list[int], cuts: set[int]) -> list[list[int]]:
    """`prompt` cut at these positions: the prefill chunks a run straight on the model uses."""
    at = sorted({c for c in cuts if 0 < c < len(prompt)} | {0, len(prompt)})
    return [prompt[a:b] for a, b in itertools.pairwise(at)]


def _cuts(model: Model, prompt: list[int], checkpoint: int, cached: int = 0) -> set[int]:
    """Where the engine ends a prefill chunk: where the reuse stops, and for recurrent (KDA) state also
    where it keeps a snapshot (the checkpoint and the last prompt token; SNAPSHOT_EVERY is past these prompts)."""
    return {cached, checkpoint, len(prompt) - 1} if _recurrent(model) else {cached}


def _recurrent(model: Model) -> bool:
    return model.manifest.family == "kimi_k3"


def _core(model: Model, snapshot_tokens: int = 4096, cache_bytes: int = 1 << 26) -> EngineCore:
    return EngineCore(
        model.net,
        model.eos_token_ids,
        SchedulerLimits(
            max_step_tokens=1 << 20,
            prompt_bytes=cache_bytes,
            prompt_snapshot_tokens=snapshot_tokens,
        ),
    )


def _same_tokens_as_cold(net: torch.nn.Module, prompt: list[int], events: list[TokenEvent]) -> None:
    """A cached continuation gives the tokens a cold prefill in one chunk gives (other rounding: logprobs close)."""
    cold = _reference(net, [prompt])
    assert [e.token_id for e in events] == [e.token_id for e in cold]
    torch.testing.assert_close(
        torch.tensor([e.logprob for e in events]),
        torch.tensor([e.logprob for e in cold]),
        atol=1e-4,
        rtol=0,
    )


@pytest.fixture(params=[1, 2])
def threads(request: pytest.FixtureRequest):
    """torch's thread count for the test: at 2, MKL's matmuls once rounded by the operands' alignment,
    so a resumed prompt differed from the same chunks run cold (deltafind sets MKL_CBWR=AUTO)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def test_next_turn_resumes_at_the_checkpoint_bit_for_bit(model: Model, threads: int) -> None:
    net, reads = model.net, model.experts.stats
    core = _core(model)
    h1 = len(HISTORY)
    turn1 = [*HISTORY, *TAIL]
    r0 = reads.requested
    events1, fin1 = _run(core, _request(turn1, h1))
    with_checkpoint = reads.requested - r0
    assert fin1.cached_tokens == 0
    r0 = reads.requested
    assert (
        _reference(net, _chunks(turn1, _cuts(model, turn1, h1))) == events1
    )  # the split chunks, and nothing else, changed the prefill
    # The snapshots read no expert: the turn costs what its chunks cost run straight on the model.
    assert with_checkpoint == reads.requested - r0
    answer = [e.token_id for e in events1]

    # Turn 2 repeats the history, then turn 1's answer (generated after TAIL, so it is prefilled
    # again), the new message and the per-request message again.
    h2 = h1 + len(answer) + len(NEW)
    turn2 = [*HISTORY, *answer, *NEW, *TAIL]
    events2, fin2 = _run(core, _request(turn2, h2))
    assert fin2.cached_tokens == h1
    assert events2 == _reference(net, _chunks(turn2, _cuts(model, turn2, h2, h1)))
    _same_tokens_as_cold(net, turn2, events2)

    # Turn 3 resumes at turn 2's checkpoint.
    turn3 = [*turn2[:h2], *[e.token_id for e in events2], 9, 9, *TAIL]
    _, fin3 = _run(core, _request(turn3, len(turn3) - len(TAIL)))
    assert fin3.cached_tokens == h2


def test_a_retry_reuses_all_but_its_last_token_and_the_next_turn_still_finds_the_checkpoint(
    model: Model,
) -> None:
    core = _core(model)
    h1, turn1 = len(HISTORY), [*HISTORY, *TAIL]
    events1, _ = _run(core, _request(turn1, h1))
    retry, fin = _run(core, _request(turn1, h1))  # the client timed out and sent it again
    assert (
        fin.cached_tokens == len(turn1) - 1
    )  # only the last token runs: its logits pick the first token
    assert [e.token_id for e in retry] == [e.token_id for e in events1]
    _same_tokens_as_cold(model.net, turn1, retry)
    again, fin = _run(core, _request(turn1, h1))
    assert fin.cached_tokens == len(turn1) - 1 and again == retry  # nothing was used up
    answer = [e.token_id for e in events1]
    turn2 = [*HISTORY, *answer, *NEW, *TAIL]
    events2, fin2 = _run(core, _request(turn2, h1 + len(answer) + len(NEW)))
    assert fin2.cached_tokens == h1  # the retries left the history's checkpoint in place
    _same_tokens_as_cold(model.net, turn2, events2)


def test_an_edit_mid_history_reuses_what_comes_before_it(model: Model) -> None:
    every = 8  # a snapshot of recurrent state every 8 prompt tokens
    core = _core(model, snapshot_tokens=every)
    turn1 = [*HISTORY, *TAIL]
    _run(core, _request(turn1, 0))
    edit = 13  # a header block that changes per request, at position 13
    edited = [*turn1[:edit], 250, *turn1[edit + 1 :]]
    events, fin = _run(core, _request(edited, 0))
    # attention K/V is cut at the edit; KDA state resumes at the last snapshot before it
    assert fin.cached_tokens == (edit // every * every if _recurrent(model) else edit)
    _same_tokens_as_cold(model.net, edited, events)


def test_a_next_turn_that_respells_the_answer_resumes_at_the_prompts_end(model: Model) -> None:
    core = _core(model)
    turn1 = [*HISTORY, *TAIL]
    events1, _ = _run(core, _request(turn1, 0))
    other = [
        (e.token_id + 1) % 240 + 3 for e in events1
    ]  # the template renders the answer in other tokens
    turn2 = [*turn1, *other, *NEW]
    events2, fin = _run(core, _request(turn2, 0))
    assert fin.cached_tokens == len(turn1)
    _same_tokens_as_cold(model.net, turn2, events2)
    # the answer as generated is reused whole (all but its last token, which was sampled, never run)
    turn3 = [*turn2, *[e.token_id for e in events2], *NEW]
    events3, fin = _run(core, _request(turn3, 0))
    assert fin.cached_tokens == len(turn2) + MAX_NEW - 1
    _same_tokens_as_cold(model.net, turn3, events3)


def test_snapshots_are_bounded_and_off_without_a_prefix_cache(model: Model) -> None:
    turn1 = [*HISTORY, *TAIL]
    off = _core(model, cache_bytes=0)
    steps: list[int] = []
    execute = off.execute
    off.execute = lambda plan: (steps.append(plan.items[0].num_tokens), execute(plan))[1]  # type: ignore[method-assign]
    _run(off, _request(turn1, len(HISTORY)))
    assert steps[0] == len(turn1)  # no cache to keep it in: the prompt is not split
    core = _core(model)
    _run(core, _request(turn1, len(HISTORY)))
    # one entry: prompt + answer, with the recurrent state at the checkpoint, the last prompt token and the prompt's end
    [entry] = core.prefix.entries()
    assert len(entry.tokens) == len(turn1) + MAX_NEW - 1
    assert sorted(entry.states) == (
        [len(HISTORY), len(turn1) - 1, len(turn1)] if _recurrent(model) else []
    )
    tight = _core(model, cache_bytes=entry.nbytes - 1)
    _run(tight, _request(turn1, len(HISTORY)))
    if _recurrent(model):  # over the budget: the earliest snapshot goes, the entry stays
        [kept] = tight.prefix.entries()
        assert (
            sorted(kept.states) == [len(turn1) - 1, len(turn1)]
            and tight.prefix.used_bytes <= entry.nbytes - 1
        )
        tight = _core(model, cache_bytes=cache_nbytes(kept.cache) - 1)
        _run(tight, _request(turn1, len(HISTORY)))
    assert (
        tight.prefix.used_bytes == 0 and len(tight.prefix) == 0
    )  # the cache alone over the budget: not kept


def test_a_checkpoint_outside_the_prompt_is_refused() -> None:
    with pytest.raises(RequestError, match="checkpoint must be in"):
        GenRequest((1, 2, 3), checkpoint=3)


def test_a_copy_is_independent_of_the_cache_it_came_from(model: Model) -> None:
    cache, fresh = SequenceCache(model.net.num_layers), SequenceCache(model.net.num_layers)
    with torch.inference_mode():
        forward_step(model.net, cache, HISTORY)
        snap = cache.copy()
        forward_step(model.net, cache, [1, 2, 3])  # the original goes on: the copy must not see it
        forward_step(model.net, fresh, HISTORY)
        assert torch.equal(
            forward_step(model.net, snap, TAIL), forward_step(model.net, fresh, TAIL)
        )
    assert snap.length == fresh.length == len(HISTORY) + len(TAIL)
