"""Weights computed on in their stored format: the decode equals gguf-py's bit for bit, and the
matmul equals the fp32-widened path (decode, then torch's matmul) within summation-order noise."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deltafind.models.ops.cpu_kernels import CPU, StoredPart
from deltafind.models.ops.stored import FusedLinear, stored_linear
from deltafind.models.ops.stored_weight import (
    BLOCKS,
    KINDS,
    StoredWeight,
    dequantize,
    gguf_dequantize,
    set_grids,
    to_row_int8,
)
from tests.conftest import avx2_kernels, gguf_blocks

needs_kernel = pytest.mark.skipif(CPU.load() is None, reason=f"no C++ compiler: {CPU.build_error}")
# gguf-py can quantize these itself; the K- and IQ4 blocks are drawn as random bytes with sane scales (conftest).
QUANTIZABLE = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
DRAWN = [
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "IQ1_S",
    "IQ1_M",
    "IQ2_XXS",
    "IQ2_XS",
    "IQ2_S",
    "IQ3_XXS",
    "IQ3_S",
    "IQ4_NL",
    "IQ4_XS",
]


@needs_kernel
@pytest.mark.parametrize("kind", QUANTIZABLE + DRAWN)
@pytest.mark.parametrize("cols", [256, 576, 1024])
def test_decode_is_bit_identical_to_gguf(kind: str, cols: int) -> None:
    if BLOCKS[kind][0] == 256 and cols % 256:
        pytest.skip("K-quants have 256-weight blocks")
    w = StoredWeight.of(gguf_blocks(kind, 37, cols, seed=cols), kind, cols)
    ours, oracle = dequantize(w), gguf_dequantize(w)
    assert torch.isfinite(oracle).all()
    assert torch.equal(
        ours.view(torch.int32), oracle.view(torch.int32)
    )  # bit for bit, signed zeros too


def _widened(x: torch.Tensor, w: StoredWeight) -> torch.Tensor:
    return F.linear(
        x,
        gguf_dequantize(w) if w.kind in BLOCKS and w.data.dtype == torch.uint8 else w.data.float(),
    )


@needs_kernel
@pytest.mark.parametrize("kind", [*QUANTIZABLE, *DRAWN, "BF16", "F16"])
@pytest.mark.parametrize("tokens", [1, 3, 9])
def test_matmul_matches_widened_path(kind: str, tokens: int) -> None:
    torch.manual_seed(tokens)
    rows, cols = 70, 512
    if kind in ("BF16", "F16"):
        w = StoredWeight.of(
            (torch.randn(rows, cols) * 0.05).to(torch.bfloat16 if kind == "BF16" else torch.float16)
        )
    else:
        w = StoredWeight.of(gguf_blocks(kind, rows, cols, seed=7), kind, cols)
    x = torch.randn(tokens, cols)
    ours, ref = stored_linear(x, w), _widened(x, w)
    assert ours.dtype == torch.float32 and ours.shape == (tokens, rows)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@needs_kernel
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "BF16"])
def test_rows_do_not_depend_on_batch(kind: str) -> None:
    """One token and the same token inside a batch give bit-identical rows (drafts verify in batches)."""
    cols = 512 if kind.endswith("_K") else 768
    w = (
        StoredWeight.of((torch.randn(33, cols) * 0.05).to(torch.bfloat16))
        if kind == "BF16"
        else StoredWeight.of(gguf_blocks(kind, 33, cols, seed=3), kind, cols)
    )
    x = torch.randn(11, cols)
    batch = stored_linear(x, w)
    for t in range(11):
        assert torch.equal(stored_linear(x[t : t + 1], w), batch[t : t + 1])


def test_torch_fallback_is_the_oracle_path() -> None:
    """Off the kernel (fp64 activations here), the matmul is the widened path exactly."""
    w = StoredWeight.of(gguf_blocks("Q4_0", 8, 64, seed=1), "Q4_0", 64)
    x = torch.randn(2, 64, dtype=torch.float64)
    assert torch.equal(stored_linear(x, w), F.linear(x, gguf_dequantize(w).double()))


def test_bad_shapes_are_refused_with_the_sizes() -> None:
    with pytest.raises(ValueError, match="Q4_0 rows of 64 weights are 36 bytes"):
        StoredWeight.of(torch.zeros(4, 35, dtype=torch.uint8), "Q4_0", 64)
    with pytest.raises(ValueError, match="bf16, fp16 or GGUF"):
        StoredWeight.of(torch.zeros(4, 4))


def test_row_int8_follows_spec_9_6() -> None:
    """Per row: f16 scale = max|w| / 127 (1 for a zero row), q = clamp(round half even(w / scale))."""
    w = torch.tensor(
        [[0.0, 0.0, 0.0, 0.0] * 8, [1.27, -2.54, 0.635, 0.0] * 8], dtype=torch.bfloat16
    )
    raw = to_row_int8(w)
    assert raw.shape == (2, 2 + 32) and raw.dtype == torch.uint8
    scales = raw[:, :2].contiguous().view(torch.float16).float().flatten()
    assert scales[0] == 1.0 and scales[1] == (w[1].float().abs().max() / 127).half().float()
    q = raw[:, 2:].view(torch.int8)
    assert q[0].eq(0).all() and q[1, 1] == -127 and q[1, 3] == 0
    assert torch.equal(
        q[1, :4], torch.round(w[1, :4].float() / (w[1].float().abs().max() / 127)).to(torch.int8)
    )


@needs_kernel
@pytest.mark.parametrize("tokens", [1, 5])
def test_row_int8_kernel_equals_its_decode(tokens: int) -> None:
    w = StoredWeight.tagged(to_row_int8(torch.randn(40, 96) * 0.05), "I8R/96")
    oracle = (
        w.data[:, :2].contiguous().view(torch.float16).float()
        * w.data[:, 2:].view(torch.int8).float()
    )
    assert torch.equal(dequantize(w), oracle)
    x = torch.randn(tokens, 96)
    torch.testing.assert_close(stored_linear(x, w), F.linear(x, oracle), rtol=1e-5, atol=1e-6)


def _weight(kind: str, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, str]:
    """(tensor, quant tag) of a stored weight: bf16, or GGUF blocks with their tag."""
    if kind == "BF16":
        return (torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05).to(
            torch.bfloat16
        ), ""
    return gguf_blocks(kind, rows, cols, seed), f"{kind}/{cols}"


@needs_kernel
@pytest.mark.parametrize("tokens", [1, 6])
def test_fused_parts_match_the_per_matrix_widened_path(tokens: int) -> None:
    """One kernel call over mixed-format matrices equals the widened matrices run one by one: rows
    stacked (q/k/v; every slice's gate then up) and side by side (a dense MLP's down slices, summed)."""
    kinds = ["Q4_1", "Q8_0", "BF16", "Q6_K", "Q5_0"]
    stacked = [_weight(k, 24 + 8 * i, 512, seed=i) for i, k in enumerate(kinds)]
    x = torch.randn(tokens, 512)
    ours = FusedLinear()(x, [w for w, _ in stacked], [q for _, q in stacked])
    widened = [
        _widened(x, StoredWeight.tagged(w, q) if q else StoredWeight.of(w)) for w, q in stacked
    ]
    ref = torch.cat(widened, dim=1)
    assert ours is not None and ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))

    side = [_weight(k, 40, 256 * (1 + i % 2), seed=10 + i) for i, k in enumerate(kinds)]
    xs = torch.randn(tokens, sum(int(w.shape[1] if not q else q.split("/")[1]) for w, q in side))
    ours = FusedLinear(stack_cols=True)(xs, [w for w, _ in side], [q for _, q in side])
    ref, c0 = torch.zeros(tokens, 40), 0
    for w, q in side:
        sw = StoredWeight.tagged(w, q) if q else StoredWeight.of(w)
        ref += _widened(xs[:, c0 : c0 + sw.cols], sw)
        c0 += sw.cols
    assert ours is not None
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    for t in range(tokens):  # a token alone and inside the batch: bit-identical rows
        alone = FusedLinear(stack_cols=True)(
            xs[t : t + 1], [w for w, _ in side], [q for _, q in side]
        )
        assert torch.equal(alone, ours[t : t + 1])


def test_fused_linear_replans_on_new_weights_and_declines_float_ones() -> None:
    fused = FusedLinear()
    a, qa = _weight("Q4_0", 16, 64, seed=1)
    x = torch.randn(2, 64)
    first = fused(x, [a], [qa])
    if CPU.load() is None:
        assert first is None  # no compiler: the caller's per-matrix path runs
        return
    b, qb = _weight("Q4_0", 16, 64, seed=2)
    second = fused(x, [b], [qb])  # a new weight object (a re-read slice, a streamed spine layer)
    assert second is not None and torch.equal(second, stored_linear(x, StoredWeight.tagged(b, qb)))
    assert fused(x, [torch.randn(16, 64)], [""]) is None  # fp32 weights: not for the stored kernel
    assert fused(x.double(), [b], [qb]) is None


@needs_kernel
def test_results_do_not_depend_on_threads_and_calls_from_many_threads_stay_separate() -> None:
    """The thread pool (cpu_pool.h): any thread count gives bit-identical rows, and back-to-back
    calls from several Python threads at once (ctypes drops the GIL) each get their own result,
    however the pool's workers, spinning or asleep, pick up each call's tasks."""
    import threading

    kinds = ["Q4_1", "Q8_0", "BF16", "Q6_K"]
    mats = [_weight(k, 200 + 16 * i, 512, seed=20 + i) for i, k in enumerate(kinds)]
    x = torch.randn(3, 512)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        ref = FusedLinear()(x, [w for w, _ in mats], [q for _, q in mats])
        assert ref is not None
        for threads in (2, 3, 5):
            torch.set_num_threads(threads)
            assert torch.equal(FusedLinear()(x, [w for w, _ in mats], [q for _, q in mats]), ref)

        torch.set_num_threads(3)
        wrong: list[int] = []

        def hammer(seed: int) -> None:
            fused, xi = FusedLinear(), x[seed % 3 : seed % 3 + 1]
            want = ref[seed % 3 : seed % 3 + 1]
            for _ in range(150):
                if not torch.equal(fused(xi, [w for w, _ in mats], [q for _, q in mats]), want):
                    wrong.append(seed)

        workers = [threading.Thread(target=hammer, args=(i,)) for i in range(4)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=120)
        assert not any(w.is_alive() for w in workers) and wrong == []
    finally:
        torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("kind", QUANTIZABLE + DRAWN)
def test_block_formats_err_like_an_fp32_matmul_against_fp64(kind: str) -> None:
    """The block formats are dotted factored per 32 (or 16) weights, d * (q . x) + m * sum(x), on AVX2,
    or decoded exactly by table on AVX-512 (stored_blocks.h): every weight exact, only the fp32
    rounding moves. Against an fp64 matmul of the same weights, its error per output, relative to
    sum |x w|, stays at the fp32 matmul's level (measured: at most 9.2e-8, the widened fp32 matmul
    4.3e-8, for 1536 columns)."""
    w = StoredWeight.of(gguf_blocks(kind, 300, 1536, seed=5), kind, 1536)
    x = torch.randn(4, 1536, generator=torch.Generator().manual_seed(5))
    exact_w = gguf_dequantize(w).double()
    exact = x.double() @ exact_w.T
    scale = x.double().abs() @ exact_w.abs().T
    ours, widened = stored_linear(x, w).double(), _widened(x, w).double()
    assert float(((ours - exact).abs() / scale).max()) < 4e-7
    assert (
        float(((widened - exact).abs() / scale).max()) < 4e-7
    )  # the bound is the fp32 matmul's own


def _parts_matmul(lib: object, w: StoredWeight, x: torch.Tensor, threads: int) -> torch.Tensor:
    set_grids(lib)
    part = (StoredPart * 1)(
        StoredPart(KINDS[w.kind], w.rows, w.cols, w.data.shape[1], w.data.data_ptr())
    )
    y = torch.empty(x.shape[0], w.rows)
    assert (
        lib.df_stored_parts(
            part, 1, 0, x.data_ptr(), x.shape[0], x.shape[1], y.data_ptr(), w.rows, threads
        )
        == 0
    )
    return y


@needs_kernel
@pytest.mark.parametrize("kind", QUANTIZABLE + DRAWN)
@pytest.mark.parametrize("cols", [1024, 2144, 2304])
def test_the_avx2_and_default_builds_both_match_the_widened_path_for_any_batch(
    kind: str, cols: int
) -> None:
    """Both builds agree with decode-then-matmul within summation-order noise, and each gives a token
    the same row alone as inside a batch of 6 (past one tile of 4). 2144 columns are 67 groups of 32:
    on AVX-512 two runs of converted scales (64, then 3), an odd group count and a scale tail; 2304
    are nine 256-weight blocks."""
    if cols % BLOCKS[kind][0]:
        pytest.skip(f"{kind} rows are whole {BLOCKS[kind][0]}-weight blocks")
    if (avx2 := avx2_kernels()).load() is None:
        pytest.skip(f"no AVX2 build on this CPU: {avx2.build_error}")
    w = StoredWeight.of(gguf_blocks(kind, 45, cols, seed=11), kind, cols)
    x = torch.randn(6, cols, generator=torch.Generator().manual_seed(11))
    ref = _widened(x, w)
    for lib in (CPU.load(), avx2.load()):
        batch = _parts_matmul(lib, w, x, threads=2)
        torch.testing.assert_close(batch, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
        for t in range(6):
            assert torch.equal(
                _parts_matmul(lib, w, x[t : t + 1].contiguous(), threads=1), batch[t : t + 1]
            )


@needs_kernel
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_every_weight_the_matmul_reads_is_its_decoded_value(kind: str) -> None:
    """x = one-hot rows pick single weights out of the matmul: each equals gguf-py's decode exactly, in both
    builds, through the one-token path (every column of a 256-weight block and of the next: each lane of
    each group) and the prefill panel (2304 columns, 83 tokens, some past the first block)."""
    if (avx2 := avx2_kernels()).load() is None:
        pytest.skip(f"no AVX2 build on this CPU: {avx2.build_error}")
    w = StoredWeight.of(gguf_blocks(kind, 9, 2304, seed=5), kind, 2304)
    oracle = gguf_dequantize(w)
    picks = torch.cat([torch.arange(512), torch.arange(512, 2304, 37)])
    x = torch.zeros(len(picks), 2304)
    x[torch.arange(len(picks)), picks] = 1.0
    for lib in (CPU.load(), avx2.load()):
        alone = torch.cat([_parts_matmul(lib, w, x[t : t + 1], threads=1) for t in range(512)])
        assert torch.equal(alone, oracle[:, :512].T)
        panel = _parts_matmul(lib, w, x[-83:].contiguous(), threads=2)
        assert torch.equal(panel, oracle[:, picks[-83:]].T)


PANEL = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "BF16", "F16", "I8R"]


def _panel_weight(kind: str, rows: int, cols: int) -> StoredWeight:
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows)) * 0.05
    if kind in ("BF16", "F16"):
        return StoredWeight.of(w.to(torch.bfloat16 if kind == "BF16" else torch.float16))
    if kind == "I8R":
        return StoredWeight.tagged(to_row_int8(w), f"I8R/{cols}")
    return StoredWeight.of(gguf_blocks(kind, rows, cols, seed=rows), kind, cols)


@needs_kernel
@pytest.mark.parametrize("kind", PANEL)
def test_prefill_rows_equal_one_token_rows(kind: str) -> None:
    """A prefill batch takes stored_panel.h on AVX-512 (decoded once per panel, 4 x 5 register tiles, 80-token
    passes): 83 tokens (a pass, then a tile and 3), 21 rows (five 4-row panels and 1), and 2304 columns
    (a 1024-column chunk twice, then 256; 72 groups) or 2144 (67 groups: an odd last chunk). Each token's row
    is bit-identical to the one it gets alone, and the batch matches the widened path."""
    cols = 2304 if kind.endswith("_K") else 2144
    w = _panel_weight(kind, 21, cols)
    x = torch.randn(83, cols, generator=torch.Generator().manual_seed(2))
    batch = stored_linear(x, w)
    oracle = dequantize(w) if kind == "I8R" else None
    ref = F.linear(x, oracle) if oracle is not None else _widened(x, w)
    torch.testing.assert_close(batch, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    for t in range(83):
        assert torch.equal(stored_linear(x[t : t + 1], w), batch[t : t + 1]), f"token {t}"


@needs_kernel
def test_prefill_parts_side_by_side_equal_one_token_rows() -> None:
    """A dense MLP's down slices in several formats, summed in one set of lanes, at prefill size: each token's
    row alone equals its row in the batch; with a format the panel lacks (Q3_K) the call takes the row path.
    The rows are 4608 and 2048 columns wide: the panel takes rows of 2048 and more (stored_panel.h)."""
    for kinds in (["Q4_1", "Q8_0", "BF16", "Q6_K", "Q4_K", "Q5_K"], ["Q6_K", "Q3_K", "BF16"]):
        side = [_weight(k, 40, 512 * (1 + i % 2), seed=20 + i) for i, k in enumerate(kinds)]
        xs = torch.randn(
            23,
            sum(512 * (1 + i % 2) for i in range(len(kinds))),
            generator=torch.Generator().manual_seed(4),
        )
        fused = FusedLinear(stack_cols=True)
        ours = fused(xs, [w for w, _ in side], [q for _, q in side])
        ref, c0 = torch.zeros(23, 40), 0
        for w, q in side:
            sw = StoredWeight.tagged(w, q) if q else StoredWeight.of(w)
            ref += _widened(xs[:, c0 : c0 + sw.cols], sw)
            c0 += sw.cols
        assert ours is not None
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
        for t in range(23):
            assert torch.equal(
                fused(xs[t : t + 1], [w for w, _ in side], [q for _, q in side]), ours[t : t + 1]
            )
