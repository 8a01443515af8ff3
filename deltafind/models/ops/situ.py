"""SiTU, Kimi K3's soft-capped gated activation, and the MLPs built on it (docs/kimi-k3-format.md §4.6-4.7).

situ(g, u) = [beta*tanh(g/beta) * sigmoid(g)] * [lbeta*tanh(u/lbeta)], evaluated in
that order in fp32. Owns the resident SiTU MLP (K3's fused shared experts); layer 0's
dense SiTU MLP runs as slices (`moe.SlicedMLP` with `gated_mlp.expert_forward`).
"""

from __future__ import annotations

import torch
from torch import nn

SITU_BETA = 4.0
SITU_LINEAR_BETA = 25.0


def situ(
    gate: torch.Tensor,
    up: torch.Tensor,
    beta: float = SITU_BETA,
    linear_beta: float = SITU_LINEAR_BETA,
) -> torch.Tensor:
    """Elementwise SiTU of gate and linear pre-activations (same shape)."""
    return (torch.tanh(gate / beta) * beta * torch.sigmoid(gate)) * (
        torch.tanh(up / linear_beta) * linear_beta
    )


class SiTUMLP(nn.Module):
    """down(situ(gate x, up x)) with resident weights under HF names (gate_proj/up_proj/down_proj)."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        beta: float = SITU_BETA,
        linear_beta: float = SITU_LINEAR_BETA,
    ) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.beta, self.linear_beta = beta, linear_beta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(situ(self.gate_proj(x), self.up_proj(x), self.beta, self.linear_beta))
