"""layer_cpu.cpp, the small per-layer ops of a CPU decode step: the rope is torch's arithmetic bit for
bit, the RMSNorm is HF's within summation order, and both step aside where they do not apply."""

from __future__ import annotations

import pytest
import torch

from deltafind.models.ops.cpu_kernels import CPU
from deltafind.models.ops.norm import RMSNorm, rms_norm_cpu
from deltafind.models.ops.rope import _rope_cpu, apply_rope, rotate_half

needs_kernel = pytest.mark.skipif(CPU.load() is None, reason=f"no C++ compiler: {CPU.build_error}")


def _hf_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm in fp32."""
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@needs_kernel
@pytest.mark.parametrize("tokens", [1, 5])
def test_rope_is_torch_arithmetic_bit_for_bit(tokens: int) -> None:
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(
        tokens, 15, 64, generator=g
    )  # q (9 heads), k (3), v (3): rope takes the first 12
    cos, sin = torch.randn(tokens, 1, 64, generator=g), torch.randn(tokens, 1, 64, generator=g)
    x = qkv[:, :12]  # a view with the token stride of all 15 heads, as the attention passes it
    ours = _rope_cpu(x, cos, sin)  # the kernel itself, not a fallback
    assert (
        ours is not None
        and ours.shape == x.shape
        and torch.equal(ours, x * cos + rotate_half(x) * sin)
    )
    assert torch.equal(apply_rope(x, cos, sin), ours)
    assert torch.equal(apply_rope(x, cos[:, 0], sin[:, 0]), ours)  # cos/sin [T, D] as well


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 576), (7, 2048), (3, 64)])
def test_rms_norm_is_hf_within_summation_order(shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(shape[1])
    x, w = torch.randn(*shape, generator=g) * 3, torch.randn(shape[1], generator=g)
    ours = rms_norm_cpu(x, w, 1e-6)
    assert ours is not None
    torch.testing.assert_close(
        ours, _hf_rms_norm(x, w, 1e-6), rtol=2e-6, atol=2e-6 * float(w.abs().max())
    )
    wide = torch.randn(shape[0], shape[1] + 8, generator=g)[:, 8:]  # rows at a stride
    torch.testing.assert_close(
        rms_norm_cpu(wide, w, 1e-6), _hf_rms_norm(wide, w, 1e-6), rtol=2e-6, atol=2e-5
    )


def test_the_torch_ops_run_where_the_kernel_does_not_apply() -> None:
    norm = RMSNorm(36, 1e-6)  # 36 columns: not a multiple of 8
    x = torch.randn(2, 36)
    assert rms_norm_cpu(x, norm.weight.data, 1e-6) is None
    torch.testing.assert_close(norm(x), _hf_rms_norm(x, norm.weight.data, 1e-6))
    xd = torch.randn(2, 3, 16, dtype=torch.float64)
    cos, sin = (
        torch.randn(2, 1, 16, dtype=torch.float64),
        torch.randn(2, 1, 16, dtype=torch.float64),
    )
    assert torch.equal(apply_rope(xd, cos, sin), xd * cos + rotate_half(xd) * sin)


@needs_kernel
@pytest.mark.parametrize(
    ("hq", "hkv", "length", "d", "dv"),
    [(9, 3, 1, 64, 64), (9, 3, 37, 64, 64), (8, 2, 100, 72, 40), (16, 16, 5, 128, 128)],
)
def test_one_row_attention_is_torchs_within_summation_order(
    hq: int, hkv: int, length: int, d: int, dv: int
) -> None:
    """Grouped-query attention of one query row over a cache ([L, Hkv, D] buffers, as LayerCache holds
    them), against the batched-matmul-and-softmax path it replaces: q head h reads kv head h // (Hq / Hkv)."""
    from deltafind.models.ops.attention import _decode_one_cpu

    g = torch.Generator().manual_seed(length)
    q = torch.randn(hq, 1, d, generator=g)
    kb, vb = torch.randn(length, hkv, d, generator=g), torch.randn(length, hkv, dv, generator=g)
    k, v = kb.transpose(0, 1), vb.transpose(0, 1)  # [Hkv, L, D] views, as attend passes them
    ours = _decode_one_cpu(q, k, v, d**-0.5)
    group = hq // hkv
    scores = torch.bmm(q.reshape(hkv, group, d), k.transpose(1, 2)) * d**-0.5
    ref = torch.bmm(torch.softmax(scores, dim=-1), v).reshape(hq, 1, dv)
    assert ours is not None
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=2e-6)
    if length > 1:  # a cache not in its buffer layout: torch's ops
        assert _decode_one_cpu(q, k.contiguous(), v, d**-0.5) is None
