"""The KDA attention layer under K3's tensor names, and its per-sequence state.

Projections, three short convs, L2-normalised q/k, beta, the forget gate, the
delta rule (ops/kda.py), per-head RMSNorm and the sigmoid output gate. Where
Kimi K3 and transformers' Kimi Linear differ, `KDAOptions` names the switch;
the defaults are K3's. State lives in the sequence's cache slot for the layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from deltafind.models.ops.batch import Batch, LayerCache
from deltafind.models.ops.kda import (
    A_FORM_LOG,
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
    a_form: str = A_FORM_LOG  # A_log holds A_log, or llama.cpp's A = -exp(A_log) ("neg_exp")
    l2norm: str = L2NORM_CLAMP
    norm_eps: float = 1e-5
    prefill: str = PREFILL_CHUNKED  # multi-row passes: chunked UT form, or deltafin's per-row loop
    chunk_size: int = 16


MAX_ROLLBACK_ROWS = 17  # a speculative verify pass: the pending token + up to 16 drafts


class RollbackError(ValueError):
    """A recurrent state was asked to roll back past what it kept."""


class KDAState:
    """One sequence's KDA state at one layer: three conv windows and S [NH, K, V] (fp32).

    A recurrent state cannot be cut back by arithmetic, so a multi-row pass on an
    existing state (a speculative verify: 2..MAX_ROLLBACK_ROWS rows) keeps what it
    started from: S before the pass and the rows' recurrence inputs (q, k, v, g,
    beta), plus each conv stream's previous window and the rows' raw inputs.
    `truncate` to r rows of that pass reruns only the recurrence over those r rows
    from the kept S, in the form an r-row pass uses, so the state is the one a pass
    of exactly the accepted rows computes; the conv window is a slice. The pass
    itself runs as before (no extra work), and a full accept costs nothing.
    Prefill and one-row decode keep nothing.
    """

    def __init__(self) -> None:
        self.conv: list[torch.Tensor | None] = [None, None, None]
        self.recurrent: torch.Tensor | None = None
        self.length = 0
        self.window_start = 0  # position before the kept pass's first row
        self.kept_rows = 0  # rows of the kept pass (0: nothing kept)
        self.kept_start: torch.Tensor | None = None  # S before the pass [NH, K, V]
        self.kept_inputs: list[
            torch.Tensor
        ] = []  # q, k [n, NH, K], v [n, NH, V], g [n, NH, K], beta [n, NH]
        self.conv_prev: list[torch.Tensor] = []  # per stream [W-1, D]: the window before the pass
        self.conv_rows: list[
            torch.Tensor
        ] = []  # per stream [n, D]: the pass's raw (pre-conv) inputs
        self.rerun: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = (
            None  # rows -> (o, S), as the layer runs them
        )

    def copy(self) -> KDAState:
        """The state as of now (conv windows and S cloned); it keeps no pass, so it rolls back nowhere."""
        new = KDAState()
        new.conv = [None if c is None else c.clone() for c in self.conv]
        new.recurrent = None if self.recurrent is None else self.recurrent.clone()
        new.length = new.window_start = self.length
        return new

    def keeps_rows(self, num_rows: int) -> bool:
        """Whether a pass of `num_rows` on this state keeps what `truncate` needs."""
        return self.recurrent is not None and 1 < num_rows <= MAX_ROLLBACK_ROWS

    def start_pass(self) -> None:
        """Forget the previous pass's rows (a new pass starts at the current position)."""
        self.window_start, self.kept_rows, self.kept_start = self.length, 0, None
        self.kept_inputs, self.conv_prev, self.conv_rows, self.rerun = [], [], [], None

    def rollback_range(self) -> tuple[int, int]:
        """Positions `truncate` can restore: (first, last), both inclusive."""
        if not self.kept_rows:
            return self.length, self.length
        return self.window_start, self.window_start + self.kept_rows

    def check_truncate(self, length: int) -> None:
        lo, hi = self.rollback_range()
        if length != 0 and not lo <= length <= hi:
            raise RollbackError(
                f"KDA state is at position {self.length} and can roll back only to positions {lo}..{hi} "
                f"(the rows of its last verify pass of 2..{MAX_ROLLBACK_ROWS} rows) or to 0; asked for {length}: "
                "run the accepted prefix again instead"
            )

    def truncate(self, length: int) -> None:
        """Restore the state after `length` positions (within the last verify pass, or 0 = reset)."""
        if length == self.length:
            return
        self.check_truncate(length)
        if length == 0:
            self.conv, self.recurrent, self.length = [None, None, None], None, 0
            self.start_pass()
            return
        r = length - self.window_start  # rows of the pass to keep
        self.kept_inputs = [t[:r] for t in self.kept_inputs]
        if r == 0:
            self.recurrent = self.kept_start
        else:
            assert self.rerun is not None
            self.recurrent = self.rerun(*self.kept_inputs, self.kept_start)[1]
        width = self.conv_prev[0].shape[0]  # W - 1
        for i in range(3):
            src = torch.cat([self.conv_prev[i], self.conv_rows[i][:r]], dim=0)  # [W-1+r, D]
            self.conv[i] = src[r : r + width].clone()
            self.conv_rows[i] = self.conv_rows[i][:r]
        self.kept_rows, self.length = r, length  # an earlier cut inside the same pass still works


def kda_state(batch_cache: list, layer_idx: int) -> KDAState:
    """The KDA state in a sequence cache's slot for this layer (created on first use)."""
    slot = batch_cache[layer_idx]
    if isinstance(slot, KDAState):
        return slot
    assert isinstance(slot, LayerCache) and slot.length == 0, (
        "a KDA layer's cache slot holds other data"
    )
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
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (
            ConvWeight(d, opts.conv_size) for _ in range(3)
        )
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

    def _recurrence(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The delta rule over one segment's rows, in the form the options choose for that many rows."""
        if q.shape[0] > 1 and self.opts.prefill == PREFILL_CHUNKED:
            return kda_chunked(q, k, v, g, beta, state, chunk_size=self.opts.chunk_size)
        return kda_recurrent(q, k, v, g, beta, state)

    def forward(self, x: torch.Tensor, batch: Batch) -> torch.Tensor:
        """x [T, H] (the input RMSNorm already applied) -> [T, H]; updates each segment's state."""
        o = self.opts
        t, nh, dk = x.shape[0], o.num_heads, o.head_dim
        raw = [self.q_proj(x), self.k_proj(x), self.v_proj(x)]  # 3 x [T, D]
        f = self.f_b_proj(self.f_a_proj(x)).view(t, nh, dk)
        g = safe_gate(
            f, self.A_log, self.dt_bias, o.gate_lower_bound, o.a_log_per_channel, o.a_form
        )  # [T, NH, K]
        beta = torch.sigmoid(self.b_proj(x).float())  # [T, NH]
        core = x.new_empty((t, nh, dk), dtype=torch.float32)
        convs = (self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight)
        for seg in batch.segments:
            sl = slice(seg.start, seg.start + seg.num_tokens)
            state = kda_state(seg.cache.layers, self.layer_idx)
            keep = state.keeps_rows(seg.num_tokens)
            state.start_pass()
            streams = []
            for i in range(3):
                u = raw[i][sl].float()  # [n, D]
                if keep:
                    state.conv_prev.append(state.conv[i])
                    state.conv_rows.append(u)
                out, state.conv[i] = short_conv(u, convs[i], state.conv[i])
                streams.append(out.view(-1, nh, dk))
            q = l2_normalize(streams[0], o.l2norm) / dk**0.5
            k = l2_normalize(streams[1], o.l2norm)
            inputs = [q, k, streams[2], g[sl], beta[sl]]
            if keep:  # a verify pass: keep where it started and its rows, for `truncate`
                state.kept_start, state.kept_inputs, state.kept_rows, state.rerun = (
                    state.recurrent,
                    inputs,
                    seg.num_tokens,
                    self._recurrence,
                )
            core[sl], state.recurrent = self._recurrence(*inputs, state.recurrent)
            state.length += seg.num_tokens
        gate = torch.sigmoid(self.output_gate(x).float().view(t, nh, dk))
        out = self.o_norm(core) * gate  # per-head RMSNorm over V, then the gate
        return self.o_proj(out.reshape(t, nh * dk).to(x.dtype))
