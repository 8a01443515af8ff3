"""The model contract: all that the engine, drafts, cluster and daemon may ask of a family.

Each family's `Model` (registry.py) is a `FamilyModel`, its `args` a `FamilyArgs`, its routed
MoE modules `RoutedExperts`; tests/unit/test_model_contract.py checks every registered family.
Code outside models/ uses these members only, never the modules under them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import torch
from torch import nn

from deltafind.store.provider import Expert

Run = Callable[[torch.Tensor, Expert], torch.Tensor]  # one routed expert on its rows: [n, H] -> [n, H]


class FamilyArgs(Protocol):
    """The ModelArgs fields read outside the family (config.json's names)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    max_position_embeddings: int  # the daemon's context limit
    tie_word_embeddings: bool


def token_widths(args: Any) -> tuple[int, int, int, int, int]:
    """(hidden, experts per token, routed expert width, MLP width, heads): what one prompt token's
    activations take, for engine/prefill.py. A dense family has no experts (0 per token)."""

    def first(*names: str, default: int = 0) -> int:
        return next((v for n in names if isinstance(v := getattr(args, n, None), int) and v > 0), default)

    hidden = first("hidden_size", default=4096)
    return (hidden, first("num_experts_per_tok", "num_experts_per_token"),
            first("routed_expert_hidden_size", default=hidden),  # K3's experts run in a latent width
            first("moe_intermediate_size", "intermediate_size", default=4 * hidden), first("num_attention_heads", default=32))


class RoutedExperts(nn.Module):
    """A layer's routed MoE: `gate` picks experts ([T, k] ids and weights), `run` computes one on its
    rows; an expert node (deltafind/cluster) runs the very same `run`."""

    gate: nn.Module
    run: Run
    layer_idx: int


class FamilyModel(nn.Module):
    """The base of every family's `Model`: embed -> `num_layers` layers -> `lm_head`, over a `Batch`.

    A family keeps HF's names: the backbone at `model`, with `embed_tokens` and `layers`.
    """

    args: FamilyArgs
    lm_head: nn.Linear  # its rows: the vocabulary the logits cover
    layer_prefix: ClassVar[bool] = True  # forward(num_layers=N) runs only the first N layers (the self-draft)

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

    def forward(self, input_ids: torch.Tensor, batch: Any, all_logits: bool = False,
                num_layers: int | None = None) -> torch.Tensor:
        """fp32 logits [T, V] for every token (all_logits) or each segment's last (`batch.logit_rows`).

        Layers named in `batch.capture` leave their output [T, H] in `batch.captured`; `num_layers`
        (only where `layer_prefix`) runs the first N layers before the norm and head, and only
        those layers' caches grow.
        """
        raise NotImplementedError

    def routed_runs(self) -> dict[int, Run]:
        """layer -> the function its routed experts run; dense layers are absent."""
        return {m.layer_idx: m.run for m in self.modules() if isinstance(m, RoutedExperts)}
