"""The softmax top-k router of one token in one kernel call (layer_cpu.cpp's df_route_token, behind
qwen3_moe.Router, which OLMoE shares): its weights are the float64 softmax's within fp32 noise, its
experts torch's wherever fp32 can tell them apart, at any thread count; it replaces the torch ops
(a regression check counts them), and whole models decode the same tokens either way."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deltafind import Model
from deltafind.importer.setup import setup_store
from deltafind.models.ops.cpu_kernels import CPU
from deltafind.models.ops.moe import predict_routed
from deltafind.models.qwen3_moe import ModelArgs, Router
from tests.conftest import avx2_kernels, make_hf_checkpoint
from tests.unit.test_fused_steps import _decode_logits

needs_kernel = pytest.mark.skipif(CPU.load() is None, reason=f"no C++ compiler: {CPU.build_error}")
RTOL = 2e-6  # fp32 logits summed in another order: ~1e-7 relative each, times the logits' size


def _router(experts: int, k: int, hidden: int, renorm: bool, seed: int) -> Router:
    args = ModelArgs(
        vocab_size=8,
        hidden_size=hidden,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=1,
        moe_intermediate_size=8,
        num_experts=experts,
        num_experts_per_tok=k,
        norm_topk_prob=renorm,
    )
    router = Router(args)
    with torch.no_grad():  # the scale of a trained router's logits (a few units)
        router.weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(seed))
    return router


def _torch_route(router: Router, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch ops' route: the kernel stepping aside."""
    router.one_token = lambda x: None  # type: ignore[method-assign]
    try:
        return router(x)
    finally:
        del router.one_token


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(
    ("experts", "k", "hidden", "renorm"),
    [
        (128, 8, 2048, True),
        (128, 8, 2048, False),
        (64, 6, 1000, True),
        (8, 2, 64, False),
        (60, 4, 2050, True),
    ],
)
def test_one_tokens_route_is_torchs_within_fp32_noise(
    experts: int, k: int, hidden: int, renorm: bool, threads: int
) -> None:
    """Weights within RTOL of the float64 softmax (and top-k renormalisation) of the same fp32 numbers;
    the experts torch's wherever the k-th and (k+1)-th probabilities differ by more than that; the
    same bits at every thread count (each logit is its row's alone)."""
    before = torch.get_num_threads()
    try:
        for seed in range(6):
            router = _router(experts, k, hidden, renorm, seed)
            x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(100 + seed))
            torch.set_num_threads(1)
            one = router.one_token(x)
            torch.set_num_threads(threads)
            got = router.one_token(x)
            assert got is not None and one is not None
            idx, weight = got
            assert idx.dtype == torch.int64 and weight.dtype == torch.float32
            assert idx.shape == weight.shape == (1, k)
            assert torch.equal(idx, one[0]) and torch.equal(weight, one[1])
            p = torch.softmax(router.weight.double() @ x[0].double(), -1)
            ranked = p.sort(descending=True)
            ref = p[idx[0]]
            if renorm:
                ref = ref / ref.sum()
            assert ((weight[0].double() - ref).abs() / ref).max() < RTOL
            if k < experts and ranked.values[k - 1] - ranked.values[k] > RTOL * ranked.values[k]:
                t_idx, t_weight = _torch_route(router, x)
                assert idx.tolist() == t_idx.tolist()
                # torch's fp32 ops stray from float64 further than the kernel (up to ~5e-6 here)
                torch.testing.assert_close(weight, t_weight, rtol=1e-5, atol=0)
    finally:
        torch.set_num_threads(before)


def _lib_route(lib: ctypes.CDLL, w: torch.Tensor, x: torch.Tensor, k: int) -> tuple[list, list]:
    ids, weights = torch.empty(k, dtype=torch.int64), torch.empty(k)
    assert not lib.df_route_token(
        w.data_ptr(), *w.shape, x.data_ptr(), k, 1, ids.data_ptr(), weights.data_ptr(), 2
    )
    return ids.tolist(), weights.tolist()


@needs_kernel
def test_the_avx2_build_routes_to_the_same_bits() -> None:
    """The logits' 16 lanes are fixed, not the vector width: the build x86 CPUs without AVX-512 run
    gives the same ids and weights bit for bit (an odd H: the tail summed after the lanes)."""
    if (avx2 := avx2_kernels().load()) is None:
        pytest.skip("no x86 AVX2 build here")
    for hidden in (2048, 1000):
        router = _router(128, 8, hidden, True, seed=hidden)
        x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(5))
        w = router.weight.detach()
        assert _lib_route(avx2, w, x, 8) == _lib_route(CPU.load(), w, x, 8)


@needs_kernel
def test_equal_probabilities_rank_the_lower_expert_first() -> None:
    """Three experts with the same (largest) logits, written in the rows 7, 2 and 5: ids 2, 5, 7."""
    router = _router(16, 4, 64, True, seed=0)
    with torch.no_grad():
        router.weight[2] = router.weight[5] = router.weight[7] = 0.5
    x = torch.ones(1, 64)
    idx, weight = router.one_token(x)
    assert idx[0, :3].tolist() == [2, 5, 7]
    assert weight[0, 0] == weight[0, 1] == weight[0, 2]


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@needs_kernel
def test_one_token_makes_no_torch_op_but_its_two_outputs() -> None:
    """Regression: the route of one token was F.linear, softmax, topk, sum and a division (five torch
    ops of 5-100 us each); now it is the kernel call and two allocations. Two tokens take the ops."""
    router = _router(128, 8, 2048, True, seed=1)
    x, empty = torch.randn(1, 2048), "aten.empty.memory_format"
    with torch.inference_mode(), _Ops() as one:
        router(x)
    assert one.ops == [empty, empty]
    with torch.inference_mode(), _Ops() as hint:
        predict_routed(
            router, x
        )  # the next layer's prefetch hint: the same call, then two tolist()
    assert [op for op in hint.ops if not op.startswith("aten.resolve_")] == [empty, empty]
    with torch.inference_mode(), _Ops() as two:
        router(torch.randn(2, 2048))
    assert "aten.topk.default" in two.ops


@needs_kernel
@pytest.mark.parametrize("bad", ["nan", "bf16", "strided"])
def test_the_torch_ops_decide_where_the_kernel_does_not_apply(bad: str) -> None:
    """A NaN in x (the kernel refuses it: torch's topk says where NaNs rank), a bf16 weight, a strided x:
    the torch ops' route, exactly."""
    router = _router(32, 4, 128, True, seed=2)
    x = torch.randn(1, 128)
    if bad == "nan":
        x[0, 3] = float("nan")
    elif bad == "bf16":  # after a token the kernel took: the same weight object, now bf16
        assert router.one_token(x) is not None
        router.to(torch.bfloat16)
        x = x.to(torch.bfloat16)
    else:
        x = torch.randn(128, 2).t()[:1]
    assert router.one_token(x) is None
    torch.testing.assert_close(router(x), _torch_route(router, x), rtol=0, atol=0, equal_nan=True)


@needs_kernel
@pytest.mark.parametrize(
    ("family", "overrides"), [("qwen3_moe", {"norm_topk_prob": True}), ("olmoe", {})]
)
def test_models_decode_the_same_tokens_with_the_router_kernel(
    family: str, overrides: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiny Qwen3-MoE (renormalised top-k) and OLMoE store: the same greedy tokens and logits within fp32
    noise with the kernel's routes as with torch's, every MoE layer of every decode step routed by ONE
    kernel call, and so the next layer's prefetch hint (a prompt's routes take the torch ops)."""
    hf = make_hf_checkpoint(family, tmp_path / "hf", seed=4, num_hidden_layers=3, **overrides)
    setup_store(hf, tmp_path / "store", [tmp_path / "d0"], progress=False)
    model = Model.open(tmp_path / "store")
    layers, steps = model.net.num_layers, 6
    prompt = torch.randint(3, 200, (7,), generator=torch.Generator().manual_seed(2)).tolist()
    calls = 0
    one_token = Router.one_token

    def counted(self: Router, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        nonlocal calls
        route = one_token(self, x)
        calls += route is not None
        return route

    try:  # in inference mode, as the engine runs
        monkeypatch.setattr(Router, "one_token", counted)
        with torch.inference_mode():
            fused, tokens = _decode_logits(model, prompt, steps)
        routed = calls  # each step's layers, and the prefetch hint of each layer after the first
        monkeypatch.setattr(Router, "one_token", lambda self, x: None)
        with torch.inference_mode():
            ref, ref_tokens = _decode_logits(model, prompt, steps)
    finally:
        model.close()
    assert tokens == ref_tokens
    assert routed == steps * (2 * layers - 1)
    for a, b in zip(fused, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * float(b.abs().max()))
