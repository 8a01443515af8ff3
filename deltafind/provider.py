"""The interface between a model and wherever its experts live.

A model asks an `ExpertProvider` for the experts its router chose at one layer
and gets tensors back; it never knows about drives, packs or caches. A family
tells the importer which checkpoint tensors are experts (`WeightNames`).
It sits below the store and the importer, which both use it, and imports nothing of deltafind.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass(frozen=True)
class Expert:
    """One routed expert (or one slice of a dense MLP) as tensors.

    `tensors` uses HF names without the layer prefix: `gate_proj`, `up_proj`
    (both [intermediate, hidden]) and `down_proj` ([hidden, intermediate]).
    """

    tensors: Mapping[str, torch.Tensor]
    nbytes: int
    quant: Mapping[str, str] = field(
        default_factory=dict
    )  # GGUF blocks: tensor name -> "KIND/COLS" (store/quant.py)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]


def _keep_all(tensors: dict[str, Any]) -> dict[str, Any]:
    return tensors


@dataclass(frozen=True)
class WeightNames:
    """How a family names the tensors of its checkpoints, for import (`importer/setup.py`).

    `routed` full-matches a routed expert's tensor, groups (layer, expert, part);
    `dense` a dense MLP's tensor (stored as slices), groups (layer, part); every
    other tensor goes to the spine. An expert record holds exactly one of
    `layouts` (its parts, in record order). `sanitize(tensors)` returns the
    tensors to import, keyed by name (what it drops is logged, never imported).
    """

    routed: re.Pattern[str]
    dense: re.Pattern[str]
    layouts: tuple[tuple[str, ...], ...] = (("gate_proj", "up_proj", "down_proj"),)
    sanitize: Callable[[dict[str, Any]], dict[str, Any]] = _keep_all


_PROJ = r"(gate_proj|up_proj|down_proj)"
HF_WEIGHTS = (
    WeightNames(  # transformers' names for SwiGLU experts and MLPs (Llama, Qwen3, DeepSeek-V3)
        routed=re.compile(rf"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.{_PROJ}\.weight"),
        dense=re.compile(rf"model\.layers\.(\d+)\.mlp\.{_PROJ}\.weight"),
    )
)


class ExpertProvider(Protocol):
    """Everything a model asks of wherever its experts live (called from `models/ops/step.py`); the hooks
    after `fetch` default to nothing, so an in-memory provider subclasses this and inherits them.

    A provider whose experts are computed where they live (deltafind/cluster) also has
    `run_experts(layer_idx, x [T, D], tokens: {expert: token indices}, run) -> Iterator[(expert,
    run(x[tokens[expert]], expert))]`; `moe.dispatch` then hands it the rows instead of fetching,
    and sums the outputs as before."""

    dtype: torch.dtype | None = None  # what float experts arrive as (None: as given)

    def num_experts(self, layer_idx: int) -> int:
        """How many experts (or dense slices) layer `layer_idx` has; 0 if none."""
        ...

    def fetch(self, layer_idx: int, expert_ids: Sequence[int]) -> Iterable[tuple[int, Expert]]:
        """`(expert_id, Expert)` once for each distinct requested id, for the caller to iterate.

        Order is completion order, so a caller can compute on the first expert
        while later ones are still being read. A `list` says every expert was held
        at the call, in the order asked: a caller may then run them all at once.
        """
        ...

    def dense_held(self, layer_idx: int) -> Sequence[Expert] | None:
        """Dense layer `layer_idx`'s slices in order when they are held resident (the call is their use), else None: fetch them."""
        return None

    def held_chain(self, num_layers: int) -> Sequence[Sequence[Expert]] | None:
        """Layers 0..num_layers-1's slices (as `dense_held` gives them) when all are dense layers held
        resident and the hooks here have nothing to do for them this step (a resident spine, no trace):
        a model may then run them without the hooks, and calls `dense_held` for each it ran (their use)."""
        return None

    def begin_step(self, seq_ids: Sequence[int], positions: Sequence[int]) -> None:
        """A forward starts: token t belongs to sequence `seq_ids[t]` at `positions[t]` (router traces)."""

    def enter_layer(self, layer_idx: int) -> None:
        """Layer `layer_idx` is about to compute: its spine tensors must be in place (streamed spine)."""

    def wants_prefetch(self, layer_idx: int) -> bool:
        """Whether a `prefetch` hint for `layer_idx` could start a read (or is recorded): False lets a
        model skip computing one (a router matmul and a sort), since nothing would come of it."""
        return True

    def prefetch(self, layer_idx: int, expert_ids: Sequence[int] | None) -> None:
        """A hint: `expert_ids` are likely at `layer_idx` (None: as the previous token's route). Never changes output."""

    def observe_routes(
        self, layer_idx: int, topk_idx: torch.Tensor, topk_weight: torch.Tensor
    ) -> None:
        """The routes the layer takes, [T, k] ids and weights (every slice, weight 1, for a dense layer)."""


class DictExpertProvider(ExpertProvider):
    """Experts held in memory, keyed by (layer, expert): tests and tiny models."""

    def __init__(self, experts: Mapping[tuple[int, int], Mapping[str, torch.Tensor]]) -> None:
        self._experts = {
            key: Expert(dict(t), sum(v.numel() * v.element_size() for v in t.values()))
            for key, t in experts.items()
        }
        self._counts: dict[int, int] = {}
        for layer_idx, expert_idx in self._experts:
            self._counts[layer_idx] = max(self._counts.get(layer_idx, 0), expert_idx + 1)

    def num_experts(self, layer_idx: int) -> int:
        return self._counts.get(layer_idx, 0)

    def wants_prefetch(self, layer_idx: int) -> bool:
        return False  # every expert is held: a hint has no read to start

    def fetch(self, layer_idx: int, expert_ids: Sequence[int]) -> Iterable[tuple[int, Expert]]:
        return [(e, self._experts[(layer_idx, e)]) for e in dict.fromkeys(expert_ids)]  # all held
