"""The torch MXFP4 path on the accelerator against the CPU: decode bit for bit, matmul within fp32 bound."""

from __future__ import annotations

import pytest
import torch

from deltafind.device.select import exact_fp32
from deltafind.models.ops import mxfp4


def _pack(rows: int, cols: int, seed: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g),
        torch.randint(lo, hi, (rows, cols // 32), dtype=torch.uint8, generator=g),
    )


@pytest.mark.parametrize(("lo", "hi"), [(118, 127), (1, 255)])
def test_device_dequant_equals_cpu_bit_for_bit(accel: torch.device, lo: int, hi: int) -> None:
    packed, scale = _pack(3072, 512, seed=lo, lo=lo, hi=hi)
    want = mxfp4.dequantize(packed, scale)  # CPU: the C++ kernel where built, else torch ops
    got = mxfp4.dequantize_torch(packed.to(accel), scale.to(accel)).cpu()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_device_linear_within_fp32_bound_of_cpu(accel: torch.device) -> None:
    exact_fp32(accel)
    packed, scale = _pack(3072, 3584, seed=7, lo=118, hi=127)  # a real K3 expert matrix
    x = torch.randn(4, 3584, generator=torch.Generator().manual_seed(8))
    cpu = mxfp4.mxfp4_linear(x, packed, scale)
    dev = mxfp4.mxfp4_linear(x.to(accel), packed.to(accel), scale.to(accel)).cpu()
    w = mxfp4.dequantize_reference(packed, scale).double()
    n, u = w.shape[1], 2.0**-24
    bound = (
        2 * (n * u / (1 - n * u)) * (x.double().abs() @ w.abs().T)
    )  # each side within gamma_n of exact
    assert ((dev.double() - cpu.double()).abs() <= bound).all()
