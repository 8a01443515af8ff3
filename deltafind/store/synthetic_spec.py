"""The building blocks of synthetic layouts: how to draw one tensor, and a family's shapes.

The layouts themselves live in synthetic_families.py and synthetic_k3.py;
synthetic.py turns one into a setup `Source`. Imports nothing else of the store.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass(frozen=True)
class Spec:
    """How to draw one tensor: `kind` in normal (std), ones (1 + std*noise), uniform (lo, hi),
    log_uniform (log of U(lo, hi)), bytes (uniform uint8 in [lo, hi])."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.bfloat16
    kind: str = "normal"
    std: float = 0.0
    lo: float = 0.0
    hi: float = 1.0


def linear(out: int, inp: int, dtype: torch.dtype = torch.bfloat16, gain: float = 1.0) -> Spec:
    return Spec((out, inp), dtype, "normal", gain / math.sqrt(inp))


def norm(dim: int, dtype: torch.dtype = torch.bfloat16) -> Spec:
    return Spec((dim,), dtype, "ones", 0.1)


@dataclass
class Family:
    shapes: dict[str, dict[str, Any]]
    build: Callable[[dict[str, Any]], tuple[dict[str, Any], dict[str, Spec]]]
    write_tokenizer: Callable[[Path, dict[str, Any]], list[str]]


def draw(spec: Spec, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if spec.kind == "bytes":
        return torch.randint(int(spec.lo), int(spec.hi) + 1, spec.shape, dtype=torch.uint8, generator=g)
    if spec.kind == "normal":
        t = torch.randn(spec.shape, generator=g) * spec.std
    elif spec.kind == "ones":
        t = 1.0 + torch.randn(spec.shape, generator=g) * spec.std
    elif spec.kind in ("uniform", "log_uniform"):
        t = torch.rand(spec.shape, generator=g) * (spec.hi - spec.lo) + spec.lo
        t = t.log() if spec.kind == "log_uniform" else t
    else:
        raise ValueError(f"unknown synthetic tensor kind {spec.kind!r}")
    return t.to(spec.dtype)
