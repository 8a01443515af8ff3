"""MXFP4 (docs/kimi-k3-format.md §5): exact decode of formula-made codes and scales, and the fast paths.

The reference here is written from the spec's words (sign bit, two exponent bits,
one mantissa bit; 2^(s-127) per 32 input columns; low nibble first), not from
deltafind's decoder. Fast paths are held to a stated fp32 bound against float64.
"""

from __future__ import annotations

import math

import pytest
import torch

from deltafind.models.ops import mxfp4
from deltafind.models.ops.cpu_kernels import load_kernel
from tests.conftest import avx2_kernels


def e2m1(code: int) -> float:
    sign = -1.0 if code & 8 else 1.0
    exp, man = (code >> 1) & 3, code & 1
    mag = man * 0.5 if exp == 0 else (1.0 + man / 2) * 2.0 ** (exp - 1)
    return sign * mag


def formula_pack(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes from indices, scales 123..126, and the expected fp32 matrix built element by element."""
    code = lambda r, c: (r * 7 + c * 3 + (r * c) % 5) % 16  # noqa: E731  every code appears in every row
    scale_of = lambda r, g: 123 + (r + 2 * g) % 4  # noqa: E731
    packed = torch.tensor(
        [
            [code(r, 2 * j) | (code(r, 2 * j + 1) << 4) for j in range(cols // 2)]
            for r in range(rows)
        ],
        dtype=torch.uint8,
    )
    scale = torch.tensor(
        [[scale_of(r, g) for g in range(cols // 32)] for r in range(rows)], dtype=torch.uint8
    )
    want = torch.tensor(
        [
            [e2m1(code(r, c)) * math.ldexp(1.0, scale_of(r, c // 32) - 127) for c in range(cols)]
            for r in range(rows)
        ]
    )
    return packed, scale, want


def test_e2m1_table_is_the_spec_table() -> None:
    assert [e2m1(c) for c in range(16)] == list(mxfp4.E2M1)
    assert math.copysign(1.0, mxfp4.E2M1[8]) == -1.0  # code 8 is -0


def test_nibble_order_low_first() -> None:
    packed = torch.tensor(
        [[0x21] + [0] * 15], dtype=torch.uint8
    )  # column 0 <- 1 (0.5), column 1 <- 2 (1.0)
    scale = torch.tensor([[127]], dtype=torch.uint8)
    w = mxfp4.dequantize_reference(packed, scale)
    assert w[0, :3].tolist() == [0.5, 1.0, 0.0]


@pytest.mark.parametrize("shape", [(3, 64), (17, 96)])
def test_decode_of_formula_codes_is_exact(shape: tuple[int, int]) -> None:
    packed, scale, want = formula_pack(*shape)
    assert torch.equal(mxfp4.dequantize_reference(packed, scale), want)
    assert torch.equal(mxfp4.dequantize(packed, scale), want)  # the C++ decode where it is built


def test_all_scale_bytes_decode_to_true_powers_of_two() -> None:
    packed = torch.full((254, 16), 0x22, dtype=torch.uint8)  # 1.0 everywhere
    scale = torch.arange(1, 255, dtype=torch.uint8)[:, None]
    want = torch.tensor([math.ldexp(1.0, s - 127) for s in range(1, 255)])[:, None].expand(254, 32)
    assert torch.equal(mxfp4.dequantize(packed, scale), want)
    mxfp4.check_scales(scale)
    with pytest.raises(ValueError, match="0 or 255"):
        mxfp4.check_scales(torch.tensor([[0]], dtype=torch.uint8))


def _random_pack(rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g),
        torch.randint(118, 127, (rows, cols // 32), dtype=torch.uint8, generator=g),
    )


def fp32_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The classic dot-product bound gamma_n * sum|w||x| with n = C (any summation order)."""
    n, u = w.shape[1], 2.0**-24
    return (n * u / (1 - n * u)) * (x.double().abs() @ w.double().abs().T)


@pytest.mark.skipif(load_kernel() is None, reason="no C++ compiler: the fused kernel is not built")
def test_fused_kernel_within_fp32_bound_and_token_independent() -> None:
    packed, scale = _random_pack(200, 384)
    w = mxfp4.dequantize_reference(packed, scale)
    x = torch.randn(11, 384, generator=torch.Generator().manual_seed(1))
    y = mxfp4.fused_linear(x, packed, scale)
    exact = x.double() @ w.double().T
    assert ((y.double() - exact).abs() <= fp32_bound(x, w)).all()
    # one token alone gives the bits it gets inside a batch (8-token tiles, remainders)
    for t in (
        0,
        5,
        10,
    ):
        assert torch.equal(mxfp4.fused_linear(x[t : t + 1], packed, scale)[0], y[t])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(mxfp4.fused_linear(x, packed, scale), y)
    finally:
        torch.set_num_threads(threads)


def test_without_kernel_falls_back_to_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    packed, scale = _random_pack(32, 64, seed=4)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(5))
    monkeypatch.setattr(mxfp4, "load_kernel", lambda: None)
    assert torch.equal(
        mxfp4.mxfp4_linear(x, packed, scale),
        torch.nn.functional.linear(x, mxfp4.dequantize_reference(packed, scale)),
    )


def test_fallback_scratch_made_under_inference_mode_serves_outside_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    packed, scale = _random_pack(48, 64, seed=9)  # a size no earlier test's scratch holds
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(10))
    monkeypatch.setattr(mxfp4, "load_kernel", lambda: None)
    monkeypatch.setattr(mxfp4._local, "bufs", {}, raising=False)
    with torch.inference_mode():
        inside = mxfp4.mxfp4_linear(x, packed, scale)
    outside = mxfp4.mxfp4_linear(x, packed, scale)  # refused an inference tensor's in-place write
    assert torch.equal(inside, outside)


def test_malformed_packs_are_refused() -> None:
    packed, scale = _random_pack(4, 64)
    with pytest.raises(ValueError, match="shapes"):
        mxfp4.mxfp4_linear(torch.zeros(1, 64), packed, scale[:, :1])
    with pytest.raises(ValueError, match="uint8"):
        mxfp4.mxfp4_linear(torch.zeros(1, 64), packed.float(), scale)


@pytest.mark.skipif(load_kernel() is None, reason="no C++ compiler: the fused kernel is not built")
def test_fused_expert_half_equals_two_matmuls_and_situ() -> None:
    from deltafind.models.ops.situ import situ

    w1, w3 = _random_pack(96, 128, seed=6), _random_pack(96, 128, seed=7)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(8)) * 3
    fused = mxfp4.fused_gate_up_situ(x, w1, w3, 4.0, 25.0)
    gate, up = mxfp4.fused_linear(x, *w1), mxfp4.fused_linear(x, *w3)  # the same sums, bit for bit
    torch.testing.assert_close(
        fused, situ(gate, up), atol=1e-6, rtol=1e-6
    )  # libm vs torch tanh/exp: ulps
    assert torch.equal(mxfp4.fused_gate_up_situ(x[3:4], w1, w3, 4.0, 25.0)[0], fused[3])


@pytest.mark.skipif(load_kernel() is None, reason="no C++ compiler: the fused kernel is not built")
def test_the_avx2_and_default_builds_both_hold_the_bound_for_any_batch() -> None:
    """An AVX-512 CPU decodes by table (mxfp4_cpu.cpp rows512), others take the AVX2 code, built here
    with -mno-avx512f: each stays within the fp32 bound, and a token alone gives its row in a batch."""
    if (avx2 := avx2_kernels()).load() is None:
        pytest.skip(f"no AVX2 build on this CPU: {avx2.build_error}")
    packed, scale = _random_pack(67, 256, seed=9)
    w = mxfp4.dequantize_reference(packed, scale)
    x = torch.randn(10, 256, generator=torch.Generator().manual_seed(9))
    exact = x.double() @ w.double().T

    def run(lib: object, xs: torch.Tensor) -> torch.Tensor:
        y = torch.empty(xs.shape[0], 67)
        assert (
            lib.df_mxfp4_matmul(
                xs.data_ptr(),
                xs.shape[0],
                256,
                packed.data_ptr(),
                scale.data_ptr(),
                67,
                256,
                y.data_ptr(),
                67,
                2,
            )
            == 0
        )
        return y

    for lib in (load_kernel(), avx2.load()):
        y = run(lib, x)
        assert ((y.double() - exact).abs() <= fp32_bound(x, w)).all()
        for t in (0, 4, 9):
            assert torch.equal(run(lib, x[t : t + 1].contiguous())[0], y[t])


@pytest.mark.skipif(load_kernel() is None, reason="no C++ compiler: the fused kernel is not built")
@pytest.mark.parametrize("rows,cols,tokens", [(67, 640, 29), (35, 256, 200), (19, 128, 300)])
def test_prefill_sizes_give_each_token_its_one_token_bits(
    rows: int, cols: int, tokens: int
) -> None:
    """`mxfp4_linear` keeps prefill-sized batches on the fused kernel at any size (200 and 300 tokens
    took dequantise + BLAS before, other bits): every row is within the fp32 bound and bit for bit
    what the token gets alone. 67 rows leave a lone row after the pairs, 29 tokens a partial tile."""
    packed, scale = _random_pack(rows, cols, seed=rows)
    w = mxfp4.dequantize_reference(packed, scale)
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(cols))
    y = mxfp4.mxfp4_linear(x, packed, scale)
    assert ((y.double() - x.double() @ w.double().T).abs() <= fp32_bound(x, w)).all()
    w3 = _random_pack(rows, cols, seed=rows + 1)
    h = mxfp4.fused_gate_up_situ(x, (packed, scale), w3, 4.0, 25.0)
    for t in range(tokens):
        assert torch.equal(mxfp4.mxfp4_linear(x[t : t + 1], packed, scale)[0], y[t])
        assert torch.equal(
            mxfp4.fused_gate_up_situ(x[t : t + 1], (packed, scale), w3, 4.0, 25.0)[0], h[t]
        )
