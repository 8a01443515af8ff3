"""The scheduler: budgets hold, every sequence ends, batching/chunking/prefix reuse never change output."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deltafind import Model
from deltafind.engine.prefix_cache import PrefixCache
from deltafind.engine.sampler import SamplingParams
from deltafind.engine.scheduler import Draining, QueueFull, Scheduler, SchedulerLimits, collect
from deltafind.engine.sequence import FinishEvent, GenRequest, TokenEvent
from deltafind.importer.setup import setup_store
from deltafind.models.ops.batch import SequenceCache
from tests.conftest import make_hf_checkpoint

V = 50
STOP = 7


class FakeNet:
    """Logits depend on every token the cache holds, so a wrong cache shows in the output."""

    num_layers = 1

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.steps: list[tuple[int, int]] = []  # (segments, tokens) per forward
        self.lock = threading.Lock()

    def __call__(self, input_ids: torch.Tensor, batch, all_logits: bool = False) -> torch.Tensor:
        with self.lock:
            self.steps.append((len(batch.segments), batch.num_tokens))
        if self.delay_s:
            time.sleep(self.delay_s)
        out = []
        for seg in batch.segments:
            (held,) = seg.cache.layers[0].append(
                input_ids[seg.start : seg.start + seg.num_tokens].double()[:, None]
            )
            nxt = int(held.sum().item() * 31 + held.shape[0]) % V
            out.append(torch.nn.functional.one_hot(torch.tensor(nxt), V).float() * 10)
        batch.advance()
        return torch.stack(out)


def expected(prompt: list[int], max_new: int) -> tuple[list[int], str]:
    held, out = list(prompt), []
    while len(out) < max_new:
        t = (sum(held) * 31 + len(held)) % V
        out.append(t)
        held.append(t)
        if t == STOP:
            return out, "stop"
    return out, "length"


requests = st.lists(
    st.tuples(
        st.lists(st.integers(0, V - 1), min_size=1, max_size=24),  # prompt
        st.integers(0, 12),  # max_new
        st.one_of(st.none(), st.integers(0, 6)),  # cancel after this many events
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=requests,
    max_running=st.integers(1, 5),
    step_tokens=st.integers(1, 16),
    reuse=st.booleans(),
)
def test_every_sequence_ends_within_budgets_with_exact_output(
    reqs, max_running, step_tokens, reuse
) -> None:
    net = FakeNet()
    limits = SchedulerLimits(
        max_running=max_running,
        max_queue=64,
        max_step_tokens=step_tokens,
        max_context=64,
        prompt_bytes=1 << 20 if reuse else 0,
    )
    sched = Scheduler(net, [STOP], limits)
    try:
        handles = [
            sched.submit(GenRequest(tuple(p), SamplingParams(max_new_tokens=n))) for p, n, _ in reqs
        ]
        for (prompt, max_new, cancel_at), h in zip(reqs, handles, strict=True):
            tokens: list[int] = []
            if cancel_at == 0:
                h.cancel()
            while True:
                event = h.get(timeout=30)
                assert event is not None, "a sequence never finished"
                if isinstance(event, FinishEvent):
                    break
                assert isinstance(event, TokenEvent)
                tokens.append(event.token_id)
                if cancel_at is not None and len(tokens) == cancel_at:
                    h.cancel()
            want, why = expected(prompt, max_new)
            assert event.completion_tokens == len(tokens) <= max_new
            assert event.prompt_tokens == len(prompt)
            if event.reason == "cancelled":
                assert cancel_at is not None and tokens == want[: len(tokens)]
            else:
                assert (tokens, event.reason) == (want, why)
            assert h.get(timeout=0) is None  # nothing after the FinishEvent
        for segments, num_tokens in net.steps:
            assert segments <= max_running
            assert num_tokens <= max(step_tokens, 1)
        assert sched.snapshot()["running"] == sched.snapshot()["waiting"] == 0
        assert sched.core.prefix.used_bytes <= limits.prompt_bytes
    finally:
        sched.close()


def test_full_queue_answers_queue_full_and_drain_refuses() -> None:
    sched = Scheduler(FakeNet(delay_s=0.05), [], SchedulerLimits(max_running=1, max_queue=1))
    try:
        hs = [sched.submit(GenRequest((1,), SamplingParams(max_new_tokens=50))) for _ in range(2)]
        with pytest.raises(QueueFull):
            sched.submit(GenRequest((1,), SamplingParams(max_new_tokens=1)))
        for h in hs:
            h.cancel()
        assert [collect(h, timeout=10)[1].reason for h in hs] == ["cancelled", "cancelled"]
        sched.drain()
        with pytest.raises(Draining):
            sched.submit(GenRequest((1,), SamplingParams(max_new_tokens=1)))
        sched.resume()
        assert (
            collect(sched.submit(GenRequest((1,), SamplingParams(max_new_tokens=2))), timeout=10)[
                1
            ].reason
            == "length"
        )
    finally:
        sched.close()


def test_a_cancelled_sequence_frees_its_slot_at_once() -> None:
    net = FakeNet(delay_s=0.01)
    sched = Scheduler(net, [], SchedulerLimits(max_running=1, max_queue=4))
    try:
        long = sched.submit(
            GenRequest((1,), SamplingParams(max_new_tokens=10_000, ignore_eos=True))
        )
        short = sched.submit(GenRequest((2,), SamplingParams(max_new_tokens=3)))
        assert isinstance(long.get(timeout=5), TokenEvent)
        long.cancel()
        assert collect(short, timeout=5)[1].reason == "length"
        assert collect(long, timeout=5)[1].reason == "cancelled"
    finally:
        sched.close()


def test_penalties_and_logprobs() -> None:
    sched = Scheduler(FakeNet(), [], SchedulerLimits())
    try:
        h = sched.submit(GenRequest((3, 4), SamplingParams(max_new_tokens=3), logprobs=2))
        events = [e for e in h if isinstance(e, TokenEvent)]
        assert len(events) == 3 and all(
            e.logprob is not None and e.logprob <= 0 and len(e.top) == 2 for e in events
        )
        assert all(e.top[0][0] == e.token_id for e in events)  # greedy picks the top one
        # a frequency penalty of 2 is not enough to beat a logit margin of 10: greedy stays
        h = sched.submit(
            GenRequest((3, 4), SamplingParams(max_new_tokens=3), frequency_penalty=2.0)
        )
        assert [e.token_id for e in h if isinstance(e, TokenEvent)] == expected([3, 4], 3)[0]
    finally:
        sched.close()


def test_prefix_cache_takes_the_longest_shared_prefix_and_keeps_it() -> None:
    pc = PrefixCache(max_bytes=10_000)
    for toks in ([1, 2], [1, 2, 3]):
        c = SequenceCache(1)
        c.layers[0].append(torch.arange(len(toks) * 4.0).view(len(toks), 4))
        c.length = len(toks)
        pc.put(toks, c)
    assert len(pc) == 1  # [1, 2] is a prefix of [1, 2, 3]: merged into it
    # a retry of the same prompt: all but its last token, every time (nothing consumed)
    for _ in range(2):
        got = pc.take([1, 2, 3])
        assert got is not None and got[1] == 2 and got[0].length == 2
        assert torch.equal(got[0].layers[0].view()[0], torch.arange(8.0).view(2, 4))
    got = pc.take([1, 2, 3, 4])
    assert got is not None and got[1] == 3
    got[0].layers[0].view()[0].fill_(-1)  # the taker's copy is its own
    assert pc.take([1, 7])[1] == 1 and pc.take([9, 1]) is None  # an edit keeps what comes before it
    assert torch.equal(pc.take([1, 2, 3, 4])[0].layers[0].view()[0], torch.arange(12.0).view(3, 4))
    assert len(pc) == 1 and 0 < pc.used_bytes <= pc.max_bytes


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("sched")
    ckpt = make_hf_checkpoint(
        "qwen3_moe", root / "hf", num_hidden_layers=2, num_experts=8, num_experts_per_tok=2
    )
    setup_store(ckpt, root / "store", [root / "d0"], dense_slices=2, progress=False)
    m = Model.open(root / "store", expert_bytes=0, prefetch=False)
    yield m
    m.close()


def test_batched_chunked_and_reused_match_one_at_a_time_on_a_real_moe(tiny_model: Model) -> None:
    prompts = [[11, 42, 7, 99, 3, 150, 8], [5, 6], [200, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [77]]
    want = [tiny_model.generate(p, max_new_tokens=10) for p in prompts]
    sched = Scheduler(
        tiny_model.net,
        tiny_model.eos_token_ids,
        SchedulerLimits(max_running=4, max_step_tokens=5, prompt_bytes=1 << 24),
    )
    try:
        read0 = tiny_model.experts.stats.requested
        handles = [
            sched.submit(GenRequest(tuple(p), SamplingParams(max_new_tokens=10))) for p in prompts
        ]
        assert [collect(h, timeout=60)[0] for h in handles] == want
        # each step fetched the union of its sequences' experts once: fewer fetches than one at a time
        assert tiny_model.experts.stats.requested - read0 < sum(len(w) for w in want) * 2 * 2
        # a growing chat: the next prompt extends the last one; only the new part is prefilled
        grown = [*prompts[0], *want[0][:-1], want[0][-1], 9, 9]
        h = sched.submit(GenRequest(tuple(grown), SamplingParams(max_new_tokens=6)))
        tokens, fin = collect(h, timeout=60)
        assert fin.cached_tokens == len(prompts[0]) + len(want[0]) - 1
        assert tokens == tiny_model.generate(grown, max_new_tokens=6)
        snap = sched.snapshot()  # what status --json and /metrics show
        assert snap["prefix_hits"] == 1 and snap["prefix_reused_tokens"] == fin.cached_tokens
    finally:
        sched.close()


def test_a_failing_step_fails_its_sequences_and_the_engine_keeps_serving() -> None:
    class Flaky(FakeNet):
        fail = True

        def __call__(self, input_ids, batch, all_logits=False):
            if self.fail:
                self.fail = False
                raise RuntimeError("drive went away")
            return super().__call__(input_ids, batch, all_logits)

    sched = Scheduler(Flaky(), [], SchedulerLimits())
    try:
        _, fin = collect(
            sched.submit(GenRequest((1,), SamplingParams(max_new_tokens=2))), timeout=10
        )
        assert fin.reason == "error" and "drive went away" in (fin.error or "")
        assert (
            collect(sched.submit(GenRequest((1,), SamplingParams(max_new_tokens=2))), timeout=10)[
                1
            ].reason
            == "length"
        )
    finally:
        sched.close()


def test_scheduler_call_runs_on_the_engine_thread() -> None:
    sched = Scheduler(FakeNet(), [], SchedulerLimits())
    try:
        assert sched.call(lambda: threading.current_thread().name) == "deltafind-engine"
    finally:
        sched.close()
