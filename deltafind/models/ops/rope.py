"""Rotary position embeddings: parameter parsing, inverse frequencies, application.

Reads both config styles: transformers 5's `rope_parameters` dict and the older
`rope_theta` + `rope_scaling` keys. Supported types: default, linear, llama3, yarn.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from deltafind.errors import UnsupportedModelError
from deltafind.models.ops.cpu_kernels import CPU


def rope_parameters(config: dict[str, Any], default_theta: float = 10000.0) -> dict[str, Any]:
    """The rope parameters of a config.json, in transformers 5's normalised form."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    params.setdefault("rope_theta", config.get("rope_theta", default_theta))
    rope_type = params.pop("type", None) or params.get("rope_type") or "default"
    params["rope_type"] = rope_type
    return params


def _yarn_find_correction_dim(num_rot: float, dim: int, base: float, max_pos: int) -> float:
    return (dim * math.log(max_pos / (num_rot * 2 * math.pi))) / (2 * math.log(base))


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def inv_freq_and_scale(
    params: dict[str, Any], dim: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] and the attention scaling applied to cos/sin."""
    base = float(params["rope_theta"])
    rope_type = params["rope_type"]
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if rope_type == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if rope_type == "yarn":
        original = int(params.get("original_max_position_embeddings") or max_position_embeddings)
        # HF infers a missing factor from the two lengths (DeepSeek-style configs).
        factor = params.get("factor")
        factor = float(max_position_embeddings / original if factor is None else factor)
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            if mscale and mscale_all_dim:
                attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(
                    factor, mscale_all_dim
                )
            else:
                attention_factor = yarn_get_mscale(factor)
        beta_fast, beta_slow = (
            float(params.get("beta_fast") or 32),
            float(params.get("beta_slow") or 1),
        )
        low = _yarn_find_correction_dim(beta_fast, dim, base, original)
        high = _yarn_find_correction_dim(beta_slow, dim, base, original)
        if params.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = (torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)
        extrapolation_factor = 1 - ramp.clamp(0, 1)
        pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
        interpolation, extrapolation = 1.0 / (factor * pos_freqs), 1.0 / pos_freqs
        inv = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
        return inv, float(attention_factor)
    raise UnsupportedModelError(
        f"rope type {rope_type!r} is not supported (supported: default, linear, llama3, yarn)"
    )


class Rope:
    """cos/sin tables for positions, computed on demand. A decode step's one position is read from a block
    of `BLOCK` positions computed together: the same ops on the same values, element by element (for a
    dim that is a multiple of 32 no element takes a vector loop's scalar tail), so the same bits, and
    one decode token saves ~30 us of small ops."""

    BLOCK = 256

    def __init__(self, params: dict[str, Any], dim: int, max_position_embeddings: int) -> None:
        self.inv_freq, self.scale = inv_freq_and_scale(params, dim, max_position_embeddings)
        self._block: tuple[int, torch.Tensor, torch.Tensor] | None = (
            None  # (first position, cos, sin)
        )

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.numel() != 1 or positions.device.type != "cpu" or self.inv_freq.numel() % 16:
            return self._cos_sin(positions)
        p, block = int(positions), self._block
        if block is None or not block[0] <= p < block[0] + self.BLOCK:
            block = self._block = (p, *self._cos_sin(torch.arange(p, p + self.BLOCK)))
        i = p - block[0]
        return block[1][i : i + 1], block[2][i : i + 1]  # [1, dim] rows of the block

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = (
            positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        )  # [T, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, dim]
        return emb.cos() * self.scale, emb.sin() * self.scale


def rope_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [T, dim] shaped [T, 1, dim] for `apply_rope`, once per forward rather than per call."""
    return cos[:, None, :], sin[:, None, :]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, dim] with the half-split (HF "rotate_half") layout; cos/sin [T, dim] or
    already [T, 1, dim] (`rope_tables`)."""
    if cos.dim() == 2:
        cos, sin = cos[:, None, :], sin[:, None, :]
    if cos.dtype != x.dtype:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if (y := _rope_cpu(x, cos, sin)) is not None:
        return y
    return x * cos + rotate_half(x) * sin


def _rope_cpu(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """`apply_rope` for fp32 x [T, H, D] on the CPU in one kernel call (layer_cpu.cpp: the same
    arithmetic, bit for bit; the torch ops cost ~40 us a call), or None where it does not apply."""
    t, h, d = x.shape
    if (
        x.dtype != torch.float32
        or x.device.type != "cpu"
        or d % 2
        or x.stride(2) != 1
        or x.stride(1) != d
        or cos.shape != (t, 1, d)
        or sin.shape != (t, 1, d)
        or (lib := CPU.load()) is None
    ):
        return None
    cos, sin = cos.reshape(t, d).contiguous(), sin.reshape(t, d).contiguous()
    y = torch.empty(t, h, d)
    lib.df_rope(x.data_ptr(), t, h, d, x.stride(0), cos.data_ptr(), sin.data_ptr(), y.data_ptr())
    return y


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x whose pairs are interleaved (DeepSeek's `rope_interleave`): de-interleave, rotate."""
    t, h, d = x.shape
    x = x.view(t, h, d // 2, 2).transpose(-1, -2).reshape(t, h, d)
    return apply_rope(x, cos, sin)
