"""Mixture-of-experts dispatch: group tokens by chosen expert, run each expert once.

The experts come from an `ExpertProvider`; dispatch never knows where they live.
Dense MLPs run through the same path as N slices, all active with weight 1.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import nn

from deltafind.models.ops.gated_mlp import GatedExpert
from deltafind.models.ops.norm import RMSNorm
from deltafind.provider import Expert, ExpertProvider


def predict_routed(router: nn.Module, x: torch.Tensor) -> list[int]:
    """Distinct experts `router` would choose for any token of x (a prefetch hint), best first: the most
    chosen, and among as often chosen the higher summed routing weight. The prefetch gate starts reads
    in this order while a drive has slack (store/prefetch_gate.py); by count alone one token's eight
    tied, and the gate read the lowest expert ids first, whatever the router's scores."""
    if torch.is_grad_enabled():
        with torch.no_grad():
            idx, weight = router(x)
    else:  # the engine's forward (inference mode): a context per prediction cost a decode token ~1 us
        idx, weight = router(x)
    if (
        idx.shape[0] == 1
    ):  # one token: its k experts, each once; the same order by Python, not 7 torch ops
        pairs = zip(idx.tolist()[0], weight.tolist()[0], strict=True)
        return [e for e, _ in sorted(pairs, key=lambda p: (-p[1], p[0]))]
    ids, inverse, counts = torch.unique(idx, return_inverse=True, return_counts=True)
    score = torch.zeros(len(ids), dtype=torch.float64, device=ids.device).index_add_(
        0, inverse.reshape(-1), weight.reshape(-1).double()
    )
    by_score = torch.argsort(score, descending=True, stable=True)
    return ids[by_score[torch.argsort(counts[by_score], descending=True, stable=True)]].tolist()


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
    run once, on exactly the tokens that chose it. An expert that fails to arrive
    (an error carrying its `expert_key`) gets `rows`, the tokens (of x) that chose
    it, so the engine fails only their sequences.
    """
    provider.observe_routes(layer_idx, topk_idx, topk_weight)
    if (
        topk_idx.shape[0] == 1
        and (y := _one_token(x, topk_idx, topk_weight, provider, layer_idx, run)) is not None
    ):
        return y
    flat_idx = topk_idx.reshape(-1)  # [T*k]
    order = torch.argsort(flat_idx, stable=True)
    unique, counts = torch.unique_consecutive(flat_idx[order], return_counts=True)
    ends = torch.cumsum(counts, 0).tolist()
    span = {
        e: (end - c, end) for e, end, c in zip(unique.tolist(), ends, counts.tolist(), strict=True)
    }
    k = topk_idx.shape[1]
    partial: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    try:
        for expert_idx, y in _expert_outputs(x, order, span, k, provider, layer_idx, run):
            rows = order[span[expert_idx][0] : span[expert_idx][1]]  # positions in the flat [T*k]
            tokens = rows // k
            partial[expert_idx] = (tokens, y * topk_weight.reshape(-1)[rows].to(y.dtype)[:, None])
    except Exception as err:
        key = getattr(err, "expert_key", None)
        if key is not None and key[0] == layer_idx and key[1] in span:
            a, b = span[key[1]]
            err.rows = sorted(set((order[a:b] // k).tolist()))  # type: ignore[attr-defined]
        raise
    out = torch.zeros_like(x)
    # Sum in expert order, not arrival order: results must not depend on I/O timing.
    for expert_idx in sorted(partial):
        tokens, y = partial[expert_idx]
        out.index_add_(0, tokens, y)
    return out


def _one_token(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weight: torch.Tensor,
    provider: ExpertProvider,
    layer_idx: int,
    run: Callable[[torch.Tensor, Expert], torch.Tensor],
) -> torch.Tensor | None:
    """`dispatch` for x [1, D] whose k experts are distinct, the same arithmetic (each expert's output
    times its weight, summed onto zeros in expert order) with the route as Python ints: the general
    path's argsort, unique, cumsum and per-expert index tensors were most of a decode token's Python
    outside the kernels (tests/bench/RESULTS.md). None: the general path applies (a repeated expert,
    experts run where they live)."""
    # tolist()[0], not [0].tolist(): one torch op less, and each is slow right after a kernel
    ids = topk_idx.tolist()[0]
    col = dict(zip(ids, topk_weight.tolist()[0], strict=True))  # expert -> its weight
    if len(col) < len(ids) or getattr(provider, "run_experts", None) is not None:
        return None
    x, order = x.contiguous(), sorted(col)
    out, dtype = torch.zeros_like(x), topk_weight.dtype
    # The kernel adds each expert's output times its weight to out itself, in fp32 as `out += y * w`
    # rounds (gated_mlp.py's adder): all k in one call where the provider holds them all (its fetch
    # gives a list, in the order asked); else each as it arrives, and an expert the kernel does not take,
    # or one that arrives before an expert of a lower id, is run and held, then summed by torch at its turn.
    add = run.adder(x, out) if isinstance(run, GatedExpert) and dtype == torch.float32 else None
    ys: dict[int, torch.Tensor] = {}
    done = 0  # order[:done] are summed into out
    try:
        got = provider.fetch(layer_idx, order)
        if (
            add is not None
            and type(got) is list
            and [e for e, _ in got] == order
            and add([expert for _, expert in got], [col[e] for e in order])
        ):
            return out
        for expert_idx, expert in got:
            if add is None or expert_idx != order[done] or not add((expert,), (col[expert_idx],)):
                ys[expert_idx] = run(x, expert)
            else:
                done += 1
            while done < len(order) and (y := ys.pop(order[done], None)) is not None:
                # expert order, as index_add_ sums in the general path
                w = col[order[done]]
                # A weight of y's dtype as a Python float is the same number, and y * it the same
                # product as y * a [1, 1] tensor of it (one op, not four); of another dtype it is
                # rounded to y's first.
                out += y * (w if y.dtype == dtype else topk_weight.new_tensor(w).to(y.dtype))
                done += 1
    except Exception as err:
        key = getattr(err, "expert_key", None)
        if key is not None and key[0] == layer_idx and key[1] in col:
            err.rows = [0]  # type: ignore[attr-defined]
        raise
    return out


def _expert_outputs(
    x: torch.Tensor,
    order: torch.Tensor,
    span: dict[int, tuple[int, int]],
    k: int,
    provider: ExpertProvider,
    layer_idx: int,
    run: Callable[[torch.Tensor, Expert], torch.Tensor],
) -> Iterator[tuple[int, torch.Tensor]]:
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

    def __init__(
        self,
        layer_idx: int,
        provider: ExpertProvider,
        run: Callable[[torch.Tensor, Expert], torch.Tensor],
    ) -> None:
        super().__init__()
        self.layer_idx, self.provider, self.run = layer_idx, provider, run
        self._route: tuple[tuple[int, int, torch.device], torch.Tensor, torch.Tensor] | None = None

    def _all_slices(
        self, tokens: int, n: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The route every token takes, [T, n] slice ids and weights 1: built once per shape (never mutated)."""
        key = (tokens, n, device)
        if self._route is None or self._route[0] != key:
            route = torch.arange(n, device=device).expand(tokens, -1)
            self._route = (key, route, torch.ones(route.shape, device=device))
        return self._route[1], self._route[2]

    def predict(self, x: torch.Tensor) -> list[int]:
        return list(
            range(self.provider.num_experts(self.layer_idx))
        )  # a dense layer always needs every slice

    def forward(self, x: torch.Tensor, norm: RMSNorm | None = None) -> torch.Tensor:
        """The MLP of x [T, H], or with `norm` the decoder layer's whole MLP half x + MLP(norm(x)) (one
        kernel call with the norm and the sum, where it applies)."""
        ids = self.predict(x)
        self.provider.observe_routes(
            self.layer_idx, *self._all_slices(x.shape[0], len(ids), x.device)
        )  # [T, n]
        held = self.provider.dense_held(self.layer_idx)
        if isinstance(self.run, GatedExpert):
            if held is None:
                got = dict(self.provider.fetch(self.layer_idx, ids))
                held = [got[e] for e in ids]
            fused = self.run.slices(x, held, norm)  # one kernel call, not one matmul per slice
            if fused is not None:
                return fused
            fetched: Iterator[tuple[int, Expert]] = enumerate(held)
        else:
            fetched = (
                enumerate(held) if held is not None else self.provider.fetch(self.layer_idx, ids)
            )
        n = x if norm is None else norm(x)
        partial = {e: self.run(n, expert) for e, expert in fetched}
        out = torch.zeros_like(x)
        for e in ids:  # fixed order: results must not depend on I/O timing
            out += partial[e]
        return out if norm is None else x + out


class DenseMLP(nn.Module):
    """A resident gate/up/down MLP (shared experts), HF parameter names."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        act: Callable[[torch.Tensor], torch.Tensor],
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
