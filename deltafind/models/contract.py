"""The model contract: all that the engine, drafts, cluster and daemon may ask of a family.

Each family's `Model` (registry.py) is a `FamilyModel`, its `args` a `FamilyArgs`, its routed MoE
modules `RoutedExperts`; tests/unit/test_model_contract.py checks every registered family.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from deltafind.models.ops.moe import predict_routed
from deltafind.provider import Expert

Run = Callable[
    [torch.Tensor, Expert], torch.Tensor
]  # one routed expert on its rows: [n, H] -> [n, H]


class FamilyArgs(Protocol):
    """The ModelArgs fields read outside the family (config.json's names)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    max_position_embeddings: int  # the daemon's context limit
    tie_word_embeddings: bool


def token_widths(args: Any) -> tuple[int, int, int, int, int]:
    """(hidden, experts per token (0: dense), routed expert width, MLP width, heads) for engine/prefill.py."""

    def first(*names: str, default: int = 0) -> int:
        return next(
            (v for n in names if isinstance(v := getattr(args, n, None), int) and v > 0), default
        )

    h = first("hidden_size", default=4096)
    return (
        h,
        first("num_experts_per_tok", "num_experts_per_token"),
        first("routed_expert_hidden_size", default=h),
        first("moe_intermediate_size", "intermediate_size", default=4 * h),
        first("num_attention_heads", default=32),
    )


class RoutedExperts(nn.Module):
    """A routed MoE layer: `gate` picks experts (ids, weights [T, k]); `run` computes one on its rows,
    the very function an expert node runs (deltafind/cluster)."""

    gate: nn.Module
    run: Run
    layer_idx: int

    def predict(self, x: torch.Tensor) -> list[int]:
        """Distinct experts the router picks for x (a prefetch hint; the route itself is recomputed)."""
        return predict_routed(self.gate, x)


class FamilyModel(nn.Module):
    """A family's `Model`: HF's backbone at `model` (`embed_tokens`, `layers`), then `lm_head`."""

    args: FamilyArgs
    lm_head: nn.Linear  # its rows: the vocabulary the logits cover
    layer_prefix: ClassVar[bool] = (
        True  # forward(num_layers=N) runs the first N layers only (the self-draft)
    )
    recurrent = (
        False  # some layers hold a state that cannot be rewound (K3's KDA): prefill keeps copies
    )

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.embed_tokens

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def forward(
        self,
        input_ids: torch.Tensor,
        batch: Any,
        all_logits: bool = False,
        num_layers: int | None = None,
    ) -> torch.Tensor:
        """fp32 logits [T, V] for every token (all_logits) or each segment's last (`batch.logit_rows`); layers
        named in `batch.capture` leave their output [T, H] in `batch.captured`; with `num_layers` only the first
        N layers run (and grow their caches) before the norm and head."""
        raise NotImplementedError

    def routed_runs(self) -> dict[int, Run]:
        """layer -> the function its routed experts run; dense layers are absent."""
        return {m.layer_idx: m.run for m in self.modules() if isinstance(m, RoutedExperts)}
