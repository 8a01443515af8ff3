"""The opt-in bf16 prefill matmuls (`[device] math = "bf16"`, models/ops/fast_math.py): NOT bit-exact.

The kernel against independent references: gguf-py's decode (and MXFP4's plain reference decode)
with weights and activations rounded to bf16 by torch and summed in fp64 (the kernel's own math,
within fp32 summation noise), and the exact fp32 matmul within bf16's rounding. A row's result
does not depend on its batch. Off (the default), a model's logits are bit-identical to exact; on,
they drift a little, and the model's status says so.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltafind import Model
from deltafind.control.ctl import store_lines
from deltafind.models.ops import fast_math, mxfp4
from deltafind.models.ops.situ import situ
from deltafind.models.ops.stored import FusedLinear, stored_linear
from deltafind.models.ops.stored_weight import StoredWeight, gguf_dequantize
from tests.conftest import gguf_blocks, make_hf_checkpoint
from tests.unit.test_config import config_error

pytestmark = pytest.mark.skipif(
    not fast_math.available(), reason="needs AVX512-BF16 and the CPU kernels"
)

R, C, T = 72, 512, 37  # rows not a multiple of the 32-row tile, tokens not of the 12-token block


@pytest.fixture
def bf16_mode():
    assert fast_math.use("bf16") == "bf16"
    try:
        yield
    finally:
        fast_math.use("exact")


def _weight(kind: str) -> tuple[object, torch.Tensor]:
    """(a matmul of x, the exact fp32 weights by an independent decode) for a stored `kind`."""
    g = torch.Generator().manual_seed(3)
    if kind == "MXFP4":
        p = torch.randint(0, 256, (R, C // 2), dtype=torch.uint8, generator=g)
        s = torch.randint(118, 127, (R, C // 32), dtype=torch.uint8, generator=g)
        return (lambda x: mxfp4.mxfp4_linear(x, p, s)), mxfp4.dequantize_reference(p, s)
    if kind == "BF16":
        w = StoredWeight.of((torch.randn(R, C, generator=g) * 0.05).bfloat16())
        return (lambda x: stored_linear(x, w)), w.data.float()
    w = StoredWeight.of(gguf_blocks(kind, R, C), kind, C)
    return (lambda x: stored_linear(x, w)), gguf_dequantize(w)


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y is x @ w.T on bf16-rounded operands summed in fp32, and within bf16 rounding of the fp32 result."""
    xd, wd = x.double(), w.double()
    bound = x.abs().double() @ w.abs().double().T  # sum |x_i w_i| per output
    bf = x.bfloat16().double() @ w.bfloat16().double().T
    assert float(((y.double() - bf).abs() - 1e-5 * bound).max()) <= 0
    drift = (y.double() - xd @ wd.T).abs()
    assert float((drift - 2.0**-7 * bound).max()) <= 0  # both operands round by at most 2^-9
    assert float(drift.max()) > 0  # the bf16 path ran: fp32 would differ by ~1e-7 only


@pytest.mark.parametrize("kind", ["Q4_K", "Q8_0", "Q6_K", "BF16", "MXFP4"])
def test_bf16_kernel_against_references(kind: str, bf16_mode: None) -> None:
    matmul, w = _weight(kind)
    x = torch.randn(T, C, generator=torch.Generator().manual_seed(7))
    y = matmul(x)
    _check(y, x, w)
    assert torch.equal(matmul(x[:16]), y[:16])  # a row's result does not depend on its batch
    exact = matmul(x[: fast_math.MIN_ROWS - 1])  # fewer rows than MIN_ROWS: the exact kernels
    fast_math.use("exact")
    assert torch.equal(exact, matmul(x[: fast_math.MIN_ROWS - 1]))


@pytest.mark.parametrize("scale", [1.0, 0.003, 40.0])
def test_bf16_gate_up_situ_is_situ_of_the_bf16_matmuls(scale: float, bf16_mode: None) -> None:
    """K3's routed expert first half in one call: SiTU (situ.py) of the two bf16 matmuls above.
    The kernel's SiTU is its own vector exp/tanh: small inputs take tanh's polynomial, large ones
    saturate it and reach the exp's clamp (sigmoid of -800 and below)."""
    g = torch.Generator().manual_seed(9)
    w1, w3 = (
        (
            torch.randint(0, 256, (R, C // 2), dtype=torch.uint8, generator=g),
            torch.randint(118, 127, (R, C // 32), dtype=torch.uint8, generator=g),
        )
        for _ in range(2)
    )
    x = torch.randn(T, C, generator=g) * scale
    assert mxfp4.can_fuse(x, w1[0])
    h = mxfp4.fused_gate_up_situ(x, w1, w3, 4.0, 25.0)
    want = situ(mxfp4.mxfp4_linear(x, *w1), mxfp4.mxfp4_linear(x, *w3), 4.0, 25.0)
    torch.testing.assert_close(h, want, rtol=1e-5, atol=1e-6)
    fast_math.use("exact")
    assert not torch.equal(h, mxfp4.fused_gate_up_situ(x, w1, w3, 4.0, 25.0))


@pytest.mark.parametrize("stack_cols", [False, True])
def test_bf16_parts_stacked_and_side_by_side(stack_cols: bool, bf16_mode: None) -> None:
    """Several stored matrices in one call (q/k/v stacked; a dense MLP's down slices side by side)."""
    g = torch.Generator().manual_seed(5)
    a = (torch.randn(R, C, generator=g) * 0.05).bfloat16()
    b = gguf_blocks("Q8_0", R if stack_cols else 40, 256 if stack_cols else C, seed=2)
    b_cols = 256 if stack_cols else C
    wb = gguf_dequantize(StoredWeight.of(b, "Q8_0", b_cols))
    fused = FusedLinear(stack_cols=stack_cols)
    x = torch.randn(T, C + 256 if stack_cols else C, generator=g)
    y = fused(x, (a, b), ("", f"Q8_0/{b_cols}"))
    assert y is not None
    w = torch.cat([a.float(), wb], dim=1 if stack_cols else 0)
    _check(y, x, w)


def test_math_off_is_bit_identical_on_drifts_and_says_so(tmp_path: Path) -> None:
    """[device] math: exact (the default) gives today's logits bit for bit, also after a bf16 and a q8
    model ran in the process; bf16 moves them a little, and status/--stats carry each mode's own NOT
    bit-exact line (q8 leaves this bf16 checkpoint's weights on the exact kernels, and says it is on)."""
    hf = make_hf_checkpoint("llama", tmp_path / "hf", seed=5, dtype="bfloat16")
    from deltafind.importer.setup import setup_store

    store = tmp_path / "store"
    setup_store(hf, store, [tmp_path / "d0"], dense_slices=2, progress=False)
    ids = torch.randint(3, 200, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    runs = {}
    says = {  # each mode's own sentence in status / --stats (store_lines), not another mode's
        "bf16": "math       bf16 ([device] math): NOT bit-exact: matmuls of 16+ token rows use bf16 dot",
        "q8": "math       q8 ([device] math): NOT bit-exact: matmuls on Q4_K/Q5_K/Q6_K/Q8_0 weights use "
        "llama.cpp's int8 dot products",
    }
    modes = ("default", "bf16", "q8", "exact")
    for name, kw in ((n, {"math": n} if n != "default" else {}) for n in modes):
        m = Model.open(store, **kw)
        try:
            runs[name] = m.forward_logits(ids)
            lines = "\n".join(store_lines(m.snapshot()))
            assert ("NOT bit-exact" in lines) == (name in says)
            for mode, sentence in says.items():
                assert (sentence in lines) == (mode == name), lines
            assert m.snapshot()["math"] == (name if name in says else "exact")
        finally:
            m.close()
    assert torch.equal(runs["default"], runs["exact"])
    want, got = runs["exact"], runs["bf16"]
    assert not torch.equal(got, want)
    assert float((got - want).abs().mean()) < 0.05 * float(want.std())
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.9


def test_math_setting_names_its_values(tmp_path: Path) -> None:
    message = config_error(tmp_path / "deltafind.toml", '[device]\nmath = "fp8"\n')
    assert "device.math" in message and "'exact'" in message and "'bf16'" in message
