"""The fused decode steps of layer_cpu.cpp: a decoder layer's attention half for one token
(`AttnStep`, df_attn_decode) and a gated MLP with its norm and residual (`GatedExpert`,
df_gated_mlp). The attention step is the per-op path's arithmetic bit for bit; the MLP equals a
float64 computation of the same stored weights within fp32 noise; whole models decode the same
tokens and logits either way."""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from deltafind import Model
from deltafind.importer.setup import setup_store
from deltafind.models.ops import fast_math
from deltafind.models.ops.attention import AttnStep
from deltafind.models.ops.batch import Batch, SequenceCache
from deltafind.models.ops.cpu_kernels import CPU
from deltafind.models.ops.gated_mlp import GatedExpert, SlicesPlan, swiglu
from deltafind.models.ops.moe import dispatch
from deltafind.models.ops.norm import RMSNorm
from deltafind.provider import Expert, ExpertProvider
from tests.conftest import gguf_blocks, make_hf_checkpoint

needs_kernel = pytest.mark.skipif(CPU.load() is None, reason=f"no C++ compiler: {CPU.build_error}")


def _decode_logits(
    model: Model, prompt: list[int], steps: int
) -> tuple[list[torch.Tensor], list[int]]:
    """Greedy decode through the model's forward, one token a step: each step's logits and tokens."""
    net = model.net
    cache = SequenceCache(net.num_layers)
    logits = net(torch.tensor(prompt), Batch.of([(cache, len(prompt))]))
    out, tokens = [], []
    for _ in range(steps):
        tokens.append(int(logits[-1].argmax()))
        logits = net(torch.tensor(tokens[-1:]), Batch.of([(cache, 1)]))
        out.append(logits[-1].clone())
    return out, tokens


def _fused_and_per_op(
    model: Model,
    prompt: list[int],
    steps: int,
    monkeypatch: pytest.MonkeyPatch,
    per_op: list[tuple[type, str]],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each decode step's logits with the fused steps, then with `per_op`'s methods stepping aside (the
    per-op path); the greedy tokens must agree. Closes the model."""
    try:
        fused, fused_tokens = _decode_logits(model, prompt, steps)
        for cls, name in per_op:
            monkeypatch.setattr(cls, name, lambda *a, **k: None)
        ref, ref_tokens = _decode_logits(model, prompt, steps)
    finally:
        model.close()
    assert fused_tokens == ref_tokens
    return fused, ref


@needs_kernel
@pytest.mark.parametrize(
    ("family", "overrides"),
    [("llama", {}), ("llama", {"attention_bias": True}), ("qwen3", {}), ("qwen3_moe", {})],
)
def test_attention_step_is_the_per_op_path_bit_for_bit(
    family: str, overrides: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 weights, q/k/v biases (Llama's attention_bias), per-head q/k norms (Qwen3): the same logits to
    the last bit, every decode step, and the fused step really ran."""
    hf = make_hf_checkpoint(family, tmp_path / "hf", seed=3, dtype="bfloat16", **overrides)
    setup_store(hf, tmp_path / "store", [tmp_path / "d0"], dense_slices=2, progress=False)
    model = Model.open(tmp_path / "store")
    layers = model.net.num_layers
    prompt = torch.randint(3, 200, (7,), generator=torch.Generator().manual_seed(2)).tolist()
    ran = 0
    call = AttnStep.__call__

    def counted(self: AttnStep, *a: object) -> torch.Tensor | None:
        nonlocal ran
        y = call(self, *a)
        ran += y is not None
        return y

    monkeypatch.setattr(AttnStep, "__call__", counted)
    fused, ref = _fused_and_per_op(model, prompt, 6, monkeypatch, [(AttnStep, "__call__")])
    assert ran == 6 * layers
    for a, b in zip(fused, ref, strict=True):
        assert torch.equal(a, b)


@needs_kernel
def test_demo_decodes_the_same_with_and_without_the_fused_steps(
    demo_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The demo's Q4_1/Q8_0 blocks: the fused steps (attention, and the MLP with its norm and residual in
    one call) against the per-op path: the same greedy tokens, logits within fp32 noise."""
    model = Model.open(demo_store)
    prompt = model.tokenizer.encode("The capital of France is")
    fused, ref = _fused_and_per_op(
        model, prompt, 8, monkeypatch, [(AttnStep, "__call__"), (GatedExpert, "_fused_call")]
    )
    for a, b in zip(fused, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))


def _slices(n: int, hidden: int, inter: int, seed: int) -> list[Expert]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = {
            "gate_proj": torch.randn(inter, hidden, generator=g),
            "up_proj": torch.randn(inter, hidden, generator=g),
            "down_proj": torch.randn(hidden, inter, generator=g),
        }
        out.append(Expert({k: (v * 0.2).to(torch.bfloat16) for k, v in t.items()}, nbytes=0))
    return out


ACTS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda v: F.gelu(v, approximate="tanh"),
}


@needs_kernel
@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("tokens", [1, 5])
def test_gated_mlp_is_the_float64_mlp_of_the_stored_weights(
    act: str, with_norm: bool, tokens: int
) -> None:
    """Three bf16 slices in one kernel call (gate/up, activation, down, and with a norm the layer's
    x + MLP(norm(x))) against the same weights in float64: within fp32 noise, and one expert alone too."""
    hidden, inter = 64, 96  # the kernel takes rows of a multiple of 32 weights
    slices = _slices(3, hidden, inter, seed=tokens)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(9)) * 2
    norm = RMSNorm(hidden, 1e-6) if with_norm else None
    if norm is not None:
        norm.weight.requires_grad_(False).copy_(
            torch.rand(hidden, generator=torch.Generator().manual_seed(4)) + 0.5
        )
    run = swiglu(act)
    assert run.act >= 0  # the kernel computes this activation itself
    got = run.slices(x, slices, norm)
    assert got is not None

    x64 = x.double()
    n = (
        x64
        if norm is None
        else norm.weight.double() * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6))
    )
    ref = sum(
        F.linear(
            ACTS[act](F.linear(n, e["gate_proj"].double())) * F.linear(n, e["up_proj"].double()),
            e["down_proj"].double(),
        )
        for e in slices
    )
    ref = ref if norm is None else x64 + ref
    scale = float(ref.abs().max())
    torch.testing.assert_close(got.double(), ref, rtol=0, atol=2e-6 * scale)
    one = run(n.float(), slices[0])  # dispatch's per-expert call
    ref_one = F.linear(
        ACTS[act](F.linear(n, slices[0]["gate_proj"].double()))
        * F.linear(n, slices[0]["up_proj"].double()),
        slices[0]["down_proj"].double(),
    )
    torch.testing.assert_close(
        one.double(), ref_one, rtol=0, atol=2e-6 * float(ref_one.abs().max())
    )


@needs_kernel
@pytest.mark.parametrize("act", list(ACTS))
def test_a_prompts_gated_mlp_rows_are_a_token_alone_at_any_thread_count(act: str) -> None:
    """A prompt's activation runs on the pool in blocks of tokens: 70 tokens (three blocks, one short)
    on 2 threads give every row the bits that token gets alone on one thread."""
    slices = _slices(2, 64, 96, seed=3)
    x = torch.randn(70, 64, generator=torch.Generator().manual_seed(5)) * 2
    norm = RMSNorm(64, 1e-6)
    run, threads = swiglu(act), torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        got = run.slices(x, slices, norm)
        torch.set_num_threads(1)
        alone = [run.slices(x[t : t + 1], slices, norm) for t in (0, 31, 32, 69)]
    finally:
        torch.set_num_threads(threads)
    assert got is not None
    for t, row in zip((0, 31, 32, 69), alone, strict=True):
        assert row is not None and torch.equal(row[0], got[t])


@needs_kernel
def test_gated_mlp_plans_once_per_slice_set_and_steps_aside_where_the_kernel_does_not_apply() -> (
    None
):
    slices = _slices(2, 64, 32, seed=1)
    plan = SlicesPlan()
    assert plan.plan(slices)
    parts = plan.gate_up.parts_planned
    assert (
        plan.plan(slices) and plan.gate_up.parts_planned is parts
    )  # same objects: not planned again
    assert plan.plan(list(reversed(slices))) and plan.gate_up.parts_planned is not parts
    fp32 = [Expert({k: v.float() for k, v in e.tensors.items()}, nbytes=0) for e in slices]
    assert not SlicesPlan().plan(fp32)  # fp32 weights: the per-matrix path (the oracle)
    run = swiglu("silu")
    assert (
        run.slices(torch.randn(2, 64, dtype=torch.float64), slices) is None
    )  # not fp32 activations
    assert run.slices(torch.randn(2, 64), fp32) is None


@needs_kernel
def test_routed_experts_are_planned_once_each_while_they_live() -> None:
    """dispatch calls the layer's `run` once per routed expert, in any order: each expert's plan is
    made once and kept while the expert lives (the outputs stay the first call's, bit for bit), and
    goes with it."""
    experts = _slices(3, 64, 32, seed=2)
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(3))
    run = swiglu("silu")
    first = [run(x, e) for e in experts]
    plans = {id(e): run._plans[id(e)][1] for e in experts}
    assert all(p is not None for p in plans.values())
    for e, y in zip([*experts, *reversed(experts)], [*first, *reversed(first)], strict=True):
        assert (
            torch.equal(run(x, e), y) and run._plans[id(e)][1] is plans[id(e)]
        )  # not planned again
    fp32 = Expert({k: v.float() for k, v in experts[0].tensors.items()}, nbytes=0)
    torch.testing.assert_close(
        run(x, fp32), first[0], rtol=0, atol=1e-5
    )  # the kernel does not take it: torch's path
    assert run._plans[id(fp32)][1] is None
    del experts, fp32, e
    gc.collect()
    assert run._plans == {}  # an evicted expert's plan does not outlive it


def test_attention_step_steps_aside_for_a_batch_of_two() -> None:
    """Two sequences in one step: the per-op path (each has its own cache)."""
    step = AttnStep.__new__(AttnStep)  # never reaches its plan
    batch = Batch.of([(SequenceCache(1), 1), (SequenceCache(1), 1)])
    assert step(torch.randn(2, 64), batch, torch.randn(2, 1, 16), torch.randn(2, 1, 16)) is None


class _ArrivalOrder(ExpertProvider):
    """Experts held in memory, yielded in `arrival` order (a store yields them as their reads complete),
    or for "held" given as a list in the order asked, as a store gives experts it holds already."""

    def __init__(self, experts: dict[int, Expert], arrival: str) -> None:
        self.experts, self.arrival = experts, arrival

    def fetch(self, layer_idx: int, expert_ids: Sequence[int]) -> Iterable[tuple[int, Expert]]:
        ids = list(expert_ids)
        if self.arrival == "held":
            return [(e, self.experts[e]) for e in ids]
        return ((e, self.experts[e]) for e in (ids[::-1] if self.arrival == "reversed" else ids))


def _q_experts(n: int, hidden: int, inter: int) -> dict[int, Expert]:
    """n random experts of a Q4_K_M mix: gate/up Q4_K, down Q6_K."""
    quant = {
        "gate_proj": f"Q4_K/{hidden}",
        "up_proj": f"Q4_K/{hidden}",
        "down_proj": f"Q6_K/{inter}",
    }
    shapes = {
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }
    return {
        e: Expert(
            {
                name: gguf_blocks(quant[name][:4], *shape, seed=7 * e + i)
                for i, (name, shape) in enumerate(shapes.items())
            },
            nbytes=0,
            quant=quant,
        )
        for e in range(n)
    }


@needs_kernel
@pytest.mark.parametrize("math", ["exact", "q8"])
@pytest.mark.parametrize("arrival", ["sorted", "reversed", "held"])
def test_one_token_moe_sum_in_the_kernel_is_torchs_sum_bit_for_bit(
    math: str, arrival: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode token's experts add their output times their weight to the layer's sum inside their
    kernel call (df_gated_mlp's accumulate): the bits of torch's `out += y * w` over the experts' own
    outputs, in expert order, whatever order they arrive in, with an expert the kernel does not take
    (fp32 weights: torch's path) among them; and a batch's rows (the general path) are the same."""
    hidden, inter, n = 256, 256, 10
    experts = _q_experts(n, hidden, inter)
    shapes = {
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }
    g = torch.Generator().manual_seed(11)
    experts[3] = Expert(  # fp32: the kernel does not take it
        {name: torch.randn(shape, generator=g) * 0.05 for name, shape in shapes.items()}, nbytes=0
    )
    provider = _ArrivalOrder(experts, arrival)
    x = torch.randn(3, hidden, generator=g)
    idx = torch.tensor([[8, 3, 1, 5], [2, 3, 9, 0], [8, 3, 1, 5]])  # [T, k]
    weight = torch.rand(3, 4, generator=g).softmax(-1)
    run, calls = swiglu("silu"), Counter()
    call = GatedExpert.__call__

    def counted(self: GatedExpert, rows: torch.Tensor, expert: Expert) -> torch.Tensor:
        calls[rows.shape[0]] += 1
        return call(self, rows, expert)

    assert fast_math.use(math) == math
    try:
        batched = dispatch(x, idx, weight, provider, 0, run)  # the general path (index_add_)
        for t in range(3):
            ids, ws = idx[t].tolist(), weight[t].tolist()
            ys = {e: run(x[t : t + 1], experts[e]) for e in ids}  # each expert's own output
            ref = torch.zeros(1, hidden)
            for e, w in sorted(zip(ids, ws, strict=True)):
                ref += ys[e] * w
            monkeypatch.setattr(GatedExpert, "__call__", counted)
            calls.clear()
            got = dispatch(x[t : t + 1], idx[t : t + 1], weight[t : t + 1], provider, 0, run)
            monkeypatch.undo()
            assert torch.equal(got, ref) and torch.equal(got[0], batched[t]), t
            # in expert order (or held: the one call refuses the fp32 expert, so each is added in
            # turn), only the fp32 expert takes torch's path; arriving reversed, every expert but the
            # first (lowest id) waits for its turn as a held output
            assert calls[1] == (3 if arrival == "reversed" else 1), (t, calls)
    finally:
        fast_math.use("exact")


@needs_kernel
@pytest.mark.parametrize("math", ["exact", "q8"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_held_experts_of_a_token_make_one_kernel_call_with_torchs_sum(
    math: str, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode token whose k experts are all held runs them in ONE df_moe_token call (gate/up of all in
    one matmul, the downs in runs of rows on the pool): each expert's output is its own call's bit for
    bit, and the layer's sum torch's `out += y * w` in expert order, at any thread count."""
    hidden, inter, k = (
        512,
        768,
        8,
    )  # 768: a down of three K-blocks a row, runs of rows not a power of 2
    experts = _q_experts(12, hidden, inter)
    provider, run = _ArrivalOrder(experts, "held"), swiglu("silu")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, hidden, generator=g)
    idx = torch.tensor([[9, 2, 11, 0, 4, 7, 5, 1]])
    weight = torch.rand(1, k, generator=g).softmax(-1)
    lib, calls = CPU.load(), Counter()
    kernel = lib.df_moe_token

    def counted(*a: object) -> int:
        calls[a[1]] += 1  # k
        return kernel(*a)

    assert fast_math.use(math) == math
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        ref = torch.zeros(1, hidden)
        for e, w in sorted(zip(idx[0].tolist(), weight[0].tolist(), strict=True)):
            ref += run(x, experts[e]) * w  # each expert's own df_gated_mlp call, summed by torch
        monkeypatch.setattr(lib, "df_moe_token", counted)
        got = dispatch(x, idx, weight, provider, 0, run)
        assert calls == {k: 1}
        assert torch.equal(got, ref)
    finally:
        torch.set_num_threads(before)
        fast_math.use("exact")
