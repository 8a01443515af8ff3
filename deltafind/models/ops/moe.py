"""Mixture-of-experts dispatch: group tokens by chosen expert, run each expert once.

The experts come from an `ExpertProvider`; dispatch never knows where they live.
Dense MLPs run through the same path as N slices, all active with weight 1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from deltafind.models.ops.stored import FusedLinear, linear
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


class GatedExpert:
    """A gated-MLP expert's forward, `expert_forward` with one `gated(gate, up)`: callable per expert
    (dispatch's `run`), and `slices` runs a dense layer's slices as ONE gate/up and ONE down matmul."""

    def __init__(self, gated: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        self.gated = gated
        self._gate_up, self._down = FusedLinear(), FusedLinear(stack_cols=True)

    def __call__(self, x: torch.Tensor, expert: Expert) -> torch.Tensor:
        return expert_forward(x, expert, self.gated)

    def slices(self, x: torch.Tensor, experts: Sequence[Expert]) -> torch.Tensor | None:
        """sum_s down_s(gated(gate_s x, up_s x)) for x [T, H] in one call per half (the slices'
        matrices stay where they are), or None where the stored-format kernel does not apply."""
        parts = [(e["gate_proj"], e.quant.get("gate_proj", "")) for e in experts]
        parts += [(e["up_proj"], e.quant.get("up_proj", "")) for e in experts]
        gate_up = self._gate_up(x, [w for w, _ in parts], [q for _, q in parts])  # [T, 2I]: gates, then ups
        if gate_up is None:
            return None
        half = gate_up.shape[1] // 2
        h = self.gated(gate_up[:, :half], gate_up[:, half:])  # [T, I], slice s at its columns
        return self._down(h, [e["down_proj"] for e in experts], [e.quant.get("down_proj", "") for e in experts])


def swiglu(hidden_act: str) -> GatedExpert:
    """One SwiGLU expert (or dense slice), act(gate x) * up x, with config.json's `hidden_act`."""
    act = activation(hidden_act)
    return GatedExpert(lambda gate, up: act(gate) * up)


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
    for expert_idx, y in _expert_outputs(x, order, span, k, provider, layer_idx, run):
        rows = order[span[expert_idx][0] : span[expert_idx][1]]  # positions in the flat [T*k]
        tokens = rows // k
        partial[expert_idx] = (tokens, y * topk_weight.reshape(-1)[rows].to(y.dtype)[:, None])
    out = torch.zeros_like(x)
    # Sum in expert order, not arrival order: results must not depend on I/O timing.
    for expert_idx in sorted(partial):
        tokens, y = partial[expert_idx]
        out.index_add_(0, tokens, y)
    return out


def _expert_outputs(x: torch.Tensor, order: torch.Tensor, span: dict[int, tuple[int, int]], k: int,
                    provider: ExpertProvider, layer_idx: int,
                    run: Callable[[torch.Tensor, Expert], torch.Tensor]) -> Iterator[tuple[int, torch.Tensor]]:
    """(expert, run(its rows, expert)) in completion order: fetched and run here, or, where the provider
    runs experts where they live (`run_experts`, deltafind/cluster), computed there on the same rows
    (x[tokens] for each expert's tokens)."""
    if (remote := getattr(provider, "run_experts", None)) is not None:
        yield from remote(layer_idx, x, {e: order[a:b] // k for e, (a, b) in span.items()}, run)
        return
    for expert_idx, expert in provider.fetch(layer_idx, list(span)):
        a, b = span[expert_idx]
        yield expert_idx, run(x[order[a:b] // k], expert)


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
        self._route: tuple[tuple[int, int, torch.device], torch.Tensor, torch.Tensor] | None = None

    def _all_slices(self, tokens: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The route every token takes, [T, n] slice ids and weights 1: built once per shape (never mutated)."""
        key = (tokens, n, device)
        if self._route is None or self._route[0] != key:
            route = torch.arange(n, device=device).expand(tokens, -1)
            self._route = (key, route, torch.ones(route.shape, device=device))
        return self._route[1], self._route[2]

    def predict(self, x: torch.Tensor) -> list[int]:
        return list(range(self.provider.num_experts(self.layer_idx)))  # a dense layer always needs every slice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids = self.predict(x)
        self.provider.observe_routes(self.layer_idx, *self._all_slices(x.shape[0], len(ids), x.device))  # [T, n]
        if isinstance(self.run, GatedExpert):
            experts = dict(self.provider.fetch(self.layer_idx, ids))
            fused = self.run.slices(x, [experts[e] for e in ids])  # one matmul per half, not one per slice
            if fused is not None:
                return fused
            partial = {e: self.run(x, experts[e]) for e in ids}
        else:
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
