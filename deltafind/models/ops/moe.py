"""Mixture-of-experts dispatch: group tokens by chosen expert, run each expert once.

The experts come from an `ExpertProvider`; dispatch never knows where they live.
Dense MLPs run through the same path as N slices, all active with weight 1.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from deltafind.models.ops.stored import linear
from deltafind.store.provider import Expert, ExpertProvider

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return ACTIVATIONS[name]
    except KeyError:
        from deltafind.errors import UnsupportedModelError

        raise UnsupportedModelError(
            f"hidden_act {name!r} is not supported (supported: {', '.join(ACTIVATIONS)})"
        ) from None


def expert_forward(x: torch.Tensor, expert: Expert, gated: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """A gated-MLP expert (or dense slice): down(gated(gate x, up x)). x [n, H] -> [n, H].

    Weights are computed on in their stored format (models/ops/stored.py)."""
    q = expert.quant
    gate = linear(x, expert["gate_proj"], quant=q.get("gate_proj", ""))
    up = linear(x, expert["up_proj"], quant=q.get("up_proj", ""))
    return linear(gated(gate, up), expert["down_proj"], quant=q.get("down_proj", ""))


def swiglu(hidden_act: str) -> Callable[[torch.Tensor, Expert], torch.Tensor]:
    """One SwiGLU expert (or dense slice), act(gate x) * up x, with config.json's `hidden_act`."""
    act = activation(hidden_act)
    return partial(expert_forward, gated=lambda gate, up: act(gate) * up)


def predict_routed(router: nn.Module, x: torch.Tensor) -> list[int]:
    """Distinct experts `router` would choose for any token of x (a prefetch hint), the most chosen
    first: the prefetch gate starts reads best first while a drive has slack (store/prefetch_gate.py)."""
    with torch.no_grad():
        idx, _ = router(x)
    ids, counts = torch.unique(idx, return_counts=True)
    return ids[torch.argsort(counts, descending=True, stable=True)].tolist()


def dispatch(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weight: torch.Tensor,
    provider: ExpertProvider,
    layer_idx: int,
    run: Callable[[torch.Tensor, Expert], torch.Tensor],
) -> torch.Tensor:
    """Weighted sum of each token's chosen experts; the one route every family's experts take.

    x [T, D]; topk_idx, topk_weight [T, k]; `run(x_rows, expert)` -> [n, D]. The
    route is reported to the provider, then each distinct expert is fetched and
    run once, on exactly the tokens that chose it.
    """
    provider.observe_routes(layer_idx, topk_idx, topk_weight)
    flat_idx = topk_idx.reshape(-1)  # [T*k]
    order = torch.argsort(flat_idx, stable=True)
    unique, counts = torch.unique_consecutive(flat_idx[order], return_counts=True)
    ends = torch.cumsum(counts, 0).tolist()
    span = {e: (end - c, end) for e, end, c in zip(unique.tolist(), ends, counts.tolist(), strict=True)}
    k = topk_idx.shape[1]
    partial: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for expert_idx, expert in provider.fetch(layer_idx, unique.tolist()):
        rows = order[span[expert_idx][0] : span[expert_idx][1]]  # positions in the flat [T*k]
        tokens = rows // k
        y = run(x[tokens], expert)
        partial[expert_idx] = (tokens, y * topk_weight.reshape(-1)[rows].to(y.dtype)[:, None])
    out = torch.zeros_like(x)
    # Sum in expert order, not arrival order: results must not depend on I/O timing.
    for expert_idx in sorted(partial):
        tokens, y = partial[expert_idx]
        out.index_add_(0, tokens, y)
    return out


class SlicedMLP(nn.Module):
    """A dense MLP stored as N slices of its intermediate dimension: every token takes every slice, weight 1.

    sum_s down[:, s](act(gate[s] x) * up[s] x) equals the unsliced MLP exactly in real
    arithmetic (any elementwise activation), so a dense model runs through the expert path.
    `run(x, slice)` is one slice's forward, e.g. `swiglu("silu")`. Summed directly: through
    `dispatch` it cost 1.4-3x (tests/bench/bench_sliced_dispatch.py).
    """

    def __init__(self, layer_idx: int, provider: ExpertProvider, run: Callable[[torch.Tensor, Expert], torch.Tensor]) -> None:
        super().__init__()
        self.layer_idx, self.provider, self.run = layer_idx, provider, run

    def predict(self, x: torch.Tensor) -> list[int]:
        return list(range(self.provider.num_experts(self.layer_idx)))  # a dense layer always needs every slice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = self.predict(x)
        route = torch.arange(len(ids), device=x.device).expand(x.shape[0], -1)  # [T, n]
        self.provider.observe_routes(self.layer_idx, route, torch.ones(route.shape, device=x.device))
        partial = {e: self.run(x, expert) for e, expert in self.provider.fetch(self.layer_idx, ids)}
        out = torch.zeros_like(x)
        for e in ids:  # fixed order: results must not depend on I/O timing
            out += partial[e]
        return out


class DenseMLP(nn.Module):
    """A resident gate/up/down MLP (shared experts), HF parameter names."""

    def __init__(self, hidden: int, intermediate: int, act: Callable[[torch.Tensor], torch.Tensor], bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
