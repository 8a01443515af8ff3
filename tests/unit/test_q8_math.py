"""The opt-in `[device] math = "q8"` (q8_cpu.cpp, stored_q8.h): llama.cpp's arithmetic, NOT bit-exact.

Against an independent numpy reading of llama.cpp's definitions: x quantized to Q8_K (per 256 values
d = max/-127, codes rounded half to even, capped at 127, 16 block sums) byte for byte, Q8_0 as gguf-py
quantizes it byte for byte; the weight codes taken from the stored bytes here (checked against gguf-py's
dequantize), the integer sums per block exact in int64 and combined in fp64, so the kernel may differ only
by its fp32 combination of the blocks. Both builds (AVX-512 VNNI and AVX2) are checked; a row's result is
the same alone or in a batch; a kind without a q8 kernel stays exact, and exact mode is untouched.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from deltafind.models.ops import fast_math
from deltafind.models.ops.cpu_kernels import CPU, StoredPart
from deltafind.models.ops.stored_weight import KINDS, StoredWeight, gguf_dequantize
from tests.conftest import avx2_kernels, gguf_blocks

pytestmark = pytest.mark.skipif(CPU.load() is None, reason=f"no C++ compiler: {CPU.build_error}")
Q8K = np.dtype([("d", "<f4"), ("qs", "i1", 256), ("bsums", "<i2", 16)])  # llama.cpp's block_q8_K
Q8_0 = np.dtype([("d", "<f2"), ("qs", "i1", 32)])


@pytest.fixture
def q8_mode():
    """q8 in this process's library (fast_math.use) and in the AVX2 build's (its own copy of the mode)."""
    assert fast_math.use("q8") == "q8"
    for lib in _builds()[1:]:
        lib.df_set_math(fast_math.MODES.index("q8"))
    try:
        yield
    finally:
        fast_math.use("exact")
        for lib in _builds()[1:]:
            lib.df_set_math(0)


def _q8k(x: np.ndarray) -> np.ndarray:
    """quantize_row_q8_K_ref's definition, for each row of x [T, C]."""
    b = x.astype(np.float32).reshape(-1, 256)
    out = np.zeros(len(b), Q8K)
    peak = b[np.arange(len(b)), np.abs(b).argmax(1)]  # the first value of largest magnitude, signed
    live = peak != 0
    iscale = np.float32(-127.0) / peak[live]
    q = np.minimum(127, np.rint(iscale[:, None] * b[live])).astype(np.int8)  # rint: half to even
    out["qs"][live] = q
    out["bsums"][live] = q.reshape(-1, 16, 16).sum(-1, dtype=np.int16)
    out["d"][live] = np.float32(1.0) / iscale
    return out.reshape(x.shape[0], -1)


def _quantize(xk: int, x: torch.Tensor, lib: object) -> np.ndarray:
    dt = Q8K if xk == 15 else Q8_0
    out = np.zeros(x.numel() // (256 if xk == 15 else 32), dt)
    assert lib.df_q8_quantize(xk, x.data_ptr(), x.numel(), out.ctypes.data) == 0
    return out


def _codes(kind: str, raw: np.ndarray) -> tuple[np.ndarray, ...]:
    """(codes [R, B, n], scale per code group [R, B, G], min per group or None, d, dmin) of `kind`'s blocks."""
    b = raw.reshape(raw.shape[0], -1, {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "Q8_0": 34}[kind])
    f16 = lambda o: b[..., o : o + 2].copy().view(np.float16)[..., 0].astype(np.float32)  # noqa: E731
    if kind == "Q8_0":
        return (
            b[..., 2:].view(np.int8).astype(np.int64),
            np.ones((*b.shape[:2], 1)),
            None,
            f16(0),
            None,
        )
    if kind == "Q6_K":
        ql, qh = b[..., :128].astype(np.int64), b[..., 128:192].astype(np.int64)
        q = np.zeros((*b.shape[:2], 256), np.int64)
        for h in range(2):
            for k in range(4):
                lo = (
                    ql[..., 64 * h + 32 * (k % 2) : 64 * h + 32 * (k % 2) + 32] >> (4 * (k // 2))
                ) & 15
                hi = (qh[..., 32 * h : 32 * h + 32] >> (2 * k)) & 3
                q[..., 128 * h + 32 * k : 128 * h + 32 * k + 32] = (lo | (hi << 4)) - 32
        return q, b[..., 192:208].view(np.int8).astype(np.int64), None, f16(208), None
    s = b[..., 4:16].astype(np.int64)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    qs = b[..., 16:144] if kind == "Q4_K" else b[..., 48:176]
    q = np.zeros((*b.shape[:2], 256), np.int64)
    for j in range(4):
        q[..., 64 * j : 64 * j + 32] = qs[..., 32 * j : 32 * j + 32] & 15
        q[..., 64 * j + 32 : 64 * j + 64] = qs[..., 32 * j : 32 * j + 32] >> 4
    if kind == "Q5_K":
        qh = b[..., 16:48].astype(np.int64)
        for g in range(8):
            q[..., 32 * g : 32 * g + 32] |= ((qh >> g) & 1) << 4
    return q, sc, mn, f16(0), f16(2)


def _reference(kind: str, raw: np.ndarray, x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(y [T, R] in fp64 from exact integer block sums, the bound on an fp32 combination's error)."""
    q, sc, mn, d, dmin = _codes(kind, raw)
    R, B, n = q.shape
    if kind == "Q8_0":
        xq = quantize(x.numpy(), GGMLQuantizationType.Q8_0).view(Q8_0).reshape(x.shape[0], B)
    else:
        xq = _q8k(x.numpy())
    xv = xq["qs"].astype(np.int64)  # [T, B, n]
    G = sc.shape[-1]
    prod = np.einsum("rbn,tbn->trbn", q, xv).reshape(x.shape[0], R, B, G, n // G)
    s_int = (prod.sum(-1) * sc).sum(-1)  # [T, R, B] exact
    s_abs = (np.abs(prod).sum(-1) * np.abs(sc)).sum(-1)
    dx = xq["d"].astype(np.float32)  # [T, B]
    ds = (d[None] * dx[:, None]).astype(np.float64)  # fp32 products, as llama.cpp forms them
    y = (ds * s_int).sum(-1)
    bound = (np.abs(ds) * s_abs).sum(-1)
    if mn is not None:
        pair = xq["bsums"].astype(np.int64).reshape(x.shape[0], B, 8, 2).sum(-1)  # [T, B, 8]
        m_int = np.einsum("rbg,tbg->trb", mn, pair)
        dm = (dmin[None] * dx[:, None]).astype(np.float64)
        y -= (dm * m_int).sum(-1)
        bound += (np.abs(dm) * np.einsum("rbg,tbg->trb", mn, np.abs(pair))).sum(-1)
    return y, bound


def _matmul(
    lib: object, parts: list[StoredWeight], x: torch.Tensor, stack_cols: int = 0
) -> torch.Tensor:
    ps = (StoredPart * len(parts))(
        *(
            StoredPart(KINDS[w.kind], w.rows, w.cols, w.data.shape[1], w.data.data_ptr())
            for w in parts
        )
    )
    rows = parts[0].rows if stack_cols else sum(w.rows for w in parts)
    y = torch.empty(x.shape[0], rows)
    rc = lib.df_stored_parts(
        ps, len(parts), stack_cols, x.data_ptr(), x.shape[0], x.shape[1], y.data_ptr(), rows, 2
    )
    assert rc == 0
    return y


def _weight(kind: str, rows: int, cols: int, seed: int) -> StoredWeight:
    return StoredWeight.of(gguf_blocks(kind, rows, cols, seed=seed), kind, cols)


def _builds() -> list[object]:
    avx2 = avx2_kernels().load()
    return [CPU.load()] + ([avx2] if avx2 is not None else [])


@pytest.mark.parametrize("cols", [256, 2304])
def test_activation_blocks_are_llama_cpps(cols: int) -> None:
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(cols)) * 3
    x[1, :256] = 0.0  # an all-zero block: d = 0 and zero codes
    x[2, 5] = 2.5 * float(x[2].abs().max())  # one outlier
    for lib in _builds():
        for t in range(3):
            got = _quantize(15, x[t].contiguous(), lib)
            assert got.tobytes() == _q8k(x[t : t + 1].numpy()).tobytes()
            want = quantize(x[t : t + 1].numpy(), GGMLQuantizationType.Q8_0)
            assert _quantize(8, x[t].contiguous(), lib).tobytes() == want.tobytes()


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q5_K", "Q8_0"])
@pytest.mark.parametrize(("rows", "cols", "tokens"), [(37, 256, 1), (21, 1280, 6), (50, 2048, 3)])
def test_q8_kernels_are_llama_cpps_integer_dot(
    kind: str, rows: int, cols: int, tokens: int, q8_mode
) -> None:
    """Each build against the numpy reference: the exact integer sums per block, the fp32 combination's
    error within (blocks + 8) ulps of the sum of the blocks' magnitudes (recursive fp32 summation of
    at most `blocks` terms a lane, lane sums added in a tree of 8), and a token alone gives its row."""
    w = _weight(kind, rows, cols, seed=rows)
    raw = w.data.numpy()
    q, sc, mn, d, dmin = _codes(kind, raw)  # the codes read here decode to gguf-py's weights
    wd = (d[..., None] * sc.repeat(q.shape[-1] // sc.shape[-1], -1) * q).reshape(rows, cols)
    if mn is not None:
        wd -= (dmin[..., None] * mn.repeat(32, -1)).reshape(rows, cols)
    np.testing.assert_allclose(
        wd, gguf_dequantize(w).numpy(), rtol=1e-6, atol=1e-6 * np.abs(wd).max()
    )
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(cols + tokens))
    want, bound = _reference(kind, raw, x)
    ulps = (cols // (32 if kind == "Q8_0" else 256) + 8) * 2.0**-24
    for lib in _builds():
        y = _matmul(lib, [w], x)
        assert (np.abs(y.numpy() - want) <= ulps * bound + 1e-30).all(), lib
        for t in range(tokens):
            assert torch.equal(_matmul(lib, [w], x[t : t + 1].contiguous()), y[t : t + 1])


def test_stacked_parts_mix_q8_and_exact_kinds(q8_mode) -> None:
    """q/k/v-style stacked parts: Q4_K and Q6_K take q8; a Q4_0 part between them stays bit-exact."""
    cols, x = 512, torch.randn(5, 512, generator=torch.Generator().manual_seed(9))
    a, b, c = (
        _weight("Q4_K", 33, cols, 1),
        _weight("Q4_0", 17, cols, 2),
        _weight("Q6_K", 9, cols, 3),
    )
    y = _matmul(CPU.load(), [a, b, c], x)
    fast_math.use("exact")
    exact_b = _matmul(CPU.load(), [b], x)
    for w, got in ((a, y[:, :33]), (c, y[:, 50:])):
        want, bound = _reference(w.kind, w.data.numpy(), x)
        assert (np.abs(got.numpy() - want) <= 10 * 2.0**-24 * bound).all()
    assert torch.equal(y[:, 33:50], exact_b)


def test_side_by_side_parts_sum_in_q8(q8_mode) -> None:
    """A dense MLP's down slices (side by side): each slice's x stretch quantized on its own."""
    x = torch.randn(3, 768, generator=torch.Generator().manual_seed(4))
    a, b = _weight("Q4_K", 24, 512, 5), _weight("Q6_K", 24, 256, 6)
    y = _matmul(CPU.load(), [a, b], x, stack_cols=1)
    wa, ba = _reference("Q4_K", a.data.numpy(), x[:, :512].contiguous())
    wb, bb = _reference("Q6_K", b.data.numpy(), x[:, 512:].contiguous())
    assert (np.abs(y.numpy() - (wa + wb)) <= 12 * 2.0**-24 * (ba + bb)).all()


def test_exact_mode_is_untouched_by_q8() -> None:
    """After q8 ran, exact mode gives the exact kernel's bits again; a kind without a q8 kernel is
    bit-identical in q8 mode."""
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(8))
    w, w0 = _weight("Q4_K", 20, 512, 7), _weight("Q4_1", 20, 512, 8)
    before, before0 = _matmul(CPU.load(), [w], x), _matmul(CPU.load(), [w0], x)
    assert fast_math.use("q8") == "q8"
    try:
        assert not torch.equal(_matmul(CPU.load(), [w], x), before)
        assert torch.equal(_matmul(CPU.load(), [w0], x), before0)
    finally:
        fast_math.use("exact")
    assert torch.equal(_matmul(CPU.load(), [w], x), before)
