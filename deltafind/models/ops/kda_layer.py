"""The KDA attention layer under K3's tensor names, and its per-sequence state.

Projections, three short convs, L2-normalised q/k, beta, the forget gate, the
delta rule (ops/kda.py), per-head RMSNorm and the sigmoid output gate. Where
Kimi K3 and transformers' Kimi Linear differ, `KDAOptions` names the switch;
the defaults are K3's. State lives in the sequence's cache slot for the layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deltafind.models.ops.batch import Batch, LayerCache
from deltafind.models.ops.kda import (
    L2NORM_CLAMP,
    kda_chunked,
    kda_recurrent,
    l2_normalize,
    safe_gate,
    short_conv,
)
from deltafind.models.ops.norm import RMSNorm

PREFILL_CHUNKED = "chunked"
PREFILL_RECURRENT = "recurrent"


@dataclass(frozen=True)
class KDAOptions:
    hidden_size: int
    num_heads: int
    head_dim: int
    conv_size: int = 4
    full_rank_gate: bool = True  # K3: one g_proj [D, H]; Kimi Linear: g_b_proj(g_a_proj(x))
    gate_lower_bound: float | None = -5.0  # K3's "safe gate"; None: Kimi Linear's softplus gate
    a_log_per_channel: bool = True  # K3: A_log [K] shared by heads; Kimi Linear: one per head
    l2norm: str = L2NORM_CLAMP
    norm_eps: float = 1e-5
    prefill: str = PREFILL_CHUNKED  # multi-row passes: chunked UT form, or deltafin's per-row loop
    chunk_size: int = 16


class KDAState:
    """One sequence's KDA state at one layer: three conv windows and S [NH, K, V] (fp32)."""

    def __init__(self) -> None:
        self.conv: list[torch.Tensor | None] = [None, None, None]
        self.recurrent: torch.Tensor | None = None
        self.length = 0

    def truncate(self, length: int) -> None:
        """A recurrent state cannot be cut back: only a no-op or a reset to 0 is possible."""
        if length == self.length:
            return
        if length != 0:
            raise NotImplementedError(
                f"KDA state is at position {self.length} and cannot roll back to {length}; rerun the accepted prefix"
            )
        self.conv, self.recurrent, self.length = [None, None, None], None, 0


def kda_state(batch_cache: list, layer_idx: int) -> KDAState:
    """The KDA state in a sequence cache's slot for this layer (created on first use)."""
    slot = batch_cache[layer_idx]
    if isinstance(slot, KDAState):
        return slot
    assert isinstance(slot, LayerCache) and slot.length == 0, "a KDA layer's cache slot holds other data"
    batch_cache[layer_idx] = state = KDAState()
    return state


class ConvWeight(nn.Module):
    """Holds a depthwise conv kernel under the checkpoint's `<name>.weight` [D, 1, W]."""

    def __init__(self, channels: int, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, width))


class KimiDeltaAttention(nn.Module):
    def __init__(self, opts: KDAOptions, layer_idx: int) -> None:
        super().__init__()
        self.opts, self.layer_idx = opts, layer_idx
        h, nh, dk = opts.hidden_size, opts.num_heads, opts.head_dim
        d = nh * dk
        self.q_proj = nn.Linear(h, d, bias=False)
        self.k_proj = nn.Linear(h, d, bias=False)
        self.v_proj = nn.Linear(h, d, bias=False)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (ConvWeight(d, opts.conv_size) for _ in range(3))
        self.f_a_proj = nn.Linear(h, dk, bias=False)
        self.f_b_proj = nn.Linear(dk, d, bias=False)
        self.b_proj = nn.Linear(h, nh, bias=False)
        self.A_log = nn.Parameter(torch.empty(dk if opts.a_log_per_channel else nh))
        self.dt_bias = nn.Parameter(torch.empty(d))
        if opts.full_rank_gate:
            self.g_proj = nn.Linear(h, d, bias=False)
        else:
            self.g_a_proj = nn.Linear(h, dk, bias=False)
            self.g_b_proj = nn.Linear(dk, d, bias=False)
        self.o_norm = RMSNorm(dk, opts.norm_eps)
        self.o_proj = nn.Linear(d, h, bias=False)

    def output_gate(self, x: torch.Tensor) -> torch.Tensor:
        return self.g_proj(x) if self.opts.full_rank_gate else self.g_b_proj(self.g_a_proj(x))

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        """x [T, H] (the input RMSNorm already applied) -> [T, H]; updates each segment's state."""
        o = self.opts
        t, nh, dk = x.shape[0], o.num_heads, o.head_dim
        raw = [self.q_proj(x), self.k_proj(x), self.v_proj(x)]  # 3 x [T, D]
        f = self.f_b_proj(self.f_a_proj(x)).view(t, nh, dk)
        g = safe_gate(f, self.A_log, self.dt_bias, o.gate_lower_bound, o.a_log_per_channel)  # [T, NH, K]
        beta = torch.sigmoid(self.b_proj(x).float())  # [T, NH]
        core = x.new_empty((t, nh, dk), dtype=torch.float32)
        convs = (self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight)
        for seg in batch.segments:
            sl = slice(seg.start, seg.start + seg.num_tokens)
            state = kda_state(seg.cache.layers, self.layer_idx)
            streams = []
            for i in range(3):
                out, state.conv[i] = short_conv(raw[i][sl].float(), convs[i], state.conv[i])
                streams.append(out.view(-1, nh, dk))
            q = l2_normalize(streams[0], o.l2norm) / dk**0.5
            k = l2_normalize(streams[1], o.l2norm)
            run = kda_chunked if seg.num_tokens > 1 and o.prefill == PREFILL_CHUNKED else kda_recurrent
            kwargs = {"chunk_size": o.chunk_size} if run is kda_chunked else {}
            core[sl], state.recurrent = run(q, k, streams[2], g[sl], beta[sl], state.recurrent, **kwargs)
            state.length += seg.num_tokens
        gate = torch.sigmoid(self.output_gate(x).float().view(t, nh, dk))
        out = self.o_norm(core) * gate  # per-head RMSNorm over V, then the gate
        return self.o_proj(out.reshape(t, nh * dk).to(x.dtype))
