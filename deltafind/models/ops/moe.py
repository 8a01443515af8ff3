"""Mixture-of-experts dispatch: group tokens by chosen expert, run each expert once.

The experts come from an `ExpertProvider`; dispatch never knows where they live.
Dense MLPs run through the same path as N slices, all active with weight 1.
"""

from __future__ import annotations

from collections.abc import Callable

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


def expert_forward(x: torch.Tensor, expert: Expert, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """SwiGLU-style expert: down(act(gate x) * up x). x [n, H] -> [n, H]."""
    gate = linear(x, expert["gate_proj"], quant=expert.quant.get("gate_proj", ""))
    up = linear(x, expert["up_proj"], quant=expert.quant.get("up_proj", ""))
    return linear(act(gate) * up, expert["down_proj"], quant=expert.quant.get("down_proj", ""))


def predict_routed(router: nn.Module, x: torch.Tensor) -> list[int]:
    """Distinct experts `router` would choose for any token of x (a prefetch hint)."""
    with torch.no_grad():
        idx, _ = router(x)
    return torch.unique(idx).tolist()


def run_experts(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weight: torch.Tensor,
    provider: ExpertProvider,
    layer_idx: int,
    act: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Weighted sum of each token's chosen experts.

    x [T, H]; topk_idx, topk_weight [T, k]. Each distinct expert is fetched and
    multiplied once, on exactly the tokens that chose it.
    """
    observe = getattr(provider, "observe_routes", None)
    if observe is not None:
        observe(layer_idx, topk_idx, topk_weight)
    out = torch.zeros_like(x)
    flat_idx = topk_idx.reshape(-1)  # [T*k]
    order = torch.argsort(flat_idx, stable=True)
    sorted_experts = flat_idx[order]
    unique, counts = torch.unique_consecutive(sorted_experts, return_counts=True)
    bounds = dict(zip(unique.tolist(), torch.cumsum(counts, 0).tolist(), strict=True))
    starts = {e: end - c for e, end, c in zip(unique.tolist(), bounds.values(), counts.tolist(), strict=True)}
    k = topk_idx.shape[1]
    partial: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for expert_idx, expert in provider.fetch(layer_idx, unique.tolist()):
        rows = order[starts[expert_idx] : bounds[expert_idx]]  # positions in the flat [T*k]
        tokens = rows // k
        y = expert_forward(x[tokens], expert, act)
        w = topk_weight.reshape(-1)[rows].to(y.dtype)[:, None]
        partial[expert_idx] = (tokens, y * w)
    # Sum in expert order, not arrival order: results must not depend on I/O timing.
    for expert_idx in sorted(partial):
        tokens, y = partial[expert_idx]
        out.index_add_(0, tokens, y)
    return out


class SlicedMLP(nn.Module):
    """A dense MLP stored as N expert slices along its intermediate dimension.

    sum_s down[:, s](act(gate[s] x) * up[s] x) equals the unsliced MLP exactly in
    real arithmetic, so a dense model runs through the expert path unchanged.
    """

    def __init__(self, layer_idx: int, provider: ExpertProvider, act: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.layer_idx, self.provider, self.act = layer_idx, provider, act

    def predict_all(self) -> list[int]:
        return list(range(self.provider.num_experts(self.layer_idx)))

    def predict(self, x: torch.Tensor) -> list[int]:
        return self.predict_all()  # a dense layer always needs every slice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = self.predict_all()
        partial = {e: expert_forward(x, expert, self.act) for e, expert in self.provider.fetch(self.layer_idx, ids)}
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
