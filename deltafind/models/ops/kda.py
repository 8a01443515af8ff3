"""Kimi Delta Attention math (docs/kimi-k3-format.md §4.4): short convs, gates, the delta-rule recurrence.

Two forms of the same recurrence S_t = (I - b_t k_t k_t^T) diag(a_t) S_{t-1} + b_t k_t v_t^T,
o_t = S_t^T q_t: `kda_recurrent` (the per-token loop, deltafin's order) and
`kda_chunked` (a UT-transform over chunks, every decay factor <= 1 so nothing
overflows). All fp32. Knows nothing of layers, weights or caches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

L2NORM_CLAMP = "clamp"  # x / max(||x||, 1e-12): F.normalize, as K3/deltafin
L2NORM_ADD_EPS = "add_eps"  # x / sqrt(||x||^2 + 1e-6): transformers' and fla's kernels
A_FORM_LOG = "log"  # the A_log tensor holds A_log (the release)
A_FORM_NEG_EXP = "neg_exp"  # it holds A = -exp(A_log) (llama.cpp's ssm_a, docs/kimi-k3-gguf.md)


def short_conv(
    u: torch.Tensor, weight: torch.Tensor, state: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv + SiLU over new rows u [T, D]; weight [D, 1, W].

    `state` [W-1, D] holds the last W-1 raw inputs, oldest first (zeros at the
    start). Returns (out [T, D], new state). The taps are summed oldest first
    for every T, so one row at a time equals the whole chunk bit for bit.
    """
    t, width = u.shape[0], weight.shape[-1]
    if state is None:
        state = u.new_zeros((width - 1, u.shape[1]))
    src = torch.cat([state, u], dim=0)  # [W-1+T, D]
    w = weight[:, 0, :].to(u.dtype)  # [D, W]
    acc = src[0:t] * w[:, 0]
    for j in range(1, width):
        acc = acc + src[j : j + t] * w[:, j]
    return F.silu(acc), src[t:].clone()


def l2_normalize(x: torch.Tensor, mode: str = L2NORM_CLAMP) -> torch.Tensor:
    if mode == L2NORM_CLAMP:
        return F.normalize(x, p=2.0, dim=-1, eps=1e-12)
    if mode == L2NORM_ADD_EPS:
        return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)
    raise ValueError(f"unknown l2 normalisation {mode!r}")


def safe_gate(
    f: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None,
    per_channel: bool = True,
    a_form: str = A_FORM_LOG,
) -> torch.Tensor:
    """Log-decay g [T, NH, K] from the forget-gate projection f [T, NH, K].

    lower_bound set (K3: -5): g = lb * sigmoid(exp(A_log) * (f + dt_bias)), in (lb, 0).
    lower_bound None (Kimi Linear): g = -exp(A_log) * softplus(f + dt_bias).
    A_log holds K rates, one per key channel shared by all heads (per_channel, K3),
    or NH, one per head (Kimi Linear). With a_form "neg_exp" it holds A = -exp(A_log)
    (llama.cpp's `ssm_a`), and the rate is -A: the converter's own f32 bits, no log/exp round trip.
    """
    nh, k = f.shape[-2:]
    gr = f.float() + dt_bias.float().view(nh, k)
    a = a_log.float().reshape(1, k) if per_channel else a_log.float().reshape(nh, 1)
    if a_form == A_FORM_LOG:
        rate = torch.exp(a)
    elif a_form == A_FORM_NEG_EXP:
        rate = -a
    else:
        raise ValueError(
            f"unknown A form {a_form!r} (expected {A_FORM_LOG!r} or {A_FORM_NEG_EXP!r})"
        )
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(rate * gr)
    return -rate * torch.where(gr > 20.0, gr, torch.log1p(torch.exp(gr)))


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token delta rule. q, k [T, NH, K] (q already scaled), v [T, NH, V],
    g [T, NH, K] log-decay, beta [T, NH]. Returns (o [T, NH, V], S [NH, K, V])."""
    t, nh, dk = k.shape
    s = q.new_zeros((nh, dk, v.shape[-1])) if state is None else state
    out = q.new_empty((t, nh, v.shape[-1]))
    for i in range(t):
        s = s * torch.exp(g[i])[:, :, None]  # decay each key channel
        pred = torch.einsum("hk,hkv->hv", k[i], s)  # what the memory returns for k
        s = s + torch.einsum("hk,hv->hkv", beta[i][:, None] * k[i], v[i] - pred)
        out[i] = torch.einsum("hk,hkv->hv", q[i], s)  # read after the update
    return out, s


def kda_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    chunk_size: int = 16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence, one chunk of rows at a time (same arguments as `kda_recurrent`).

    In a chunk starting from S0, with G_t the cumulative log-decay, the new values
    u_t = b_t (v_t - k_t.(D_t S_{t-1})) solve a unit lower-triangular system
    (I + A) u = b (v - (e^G * k) S0), A[t, i] = b_t sum_c k_t k_i e^(G_t - G_i) (i < t);
    then o_t = (e^G_t q_t) S0 + sum_{i<=t} (sum_c q_t k_i e^(G_t - G_i)) u_i.
    """
    t, nh, dk = k.shape
    s = q.new_zeros((nh, dk, v.shape[-1])) if state is None else state
    out = q.new_empty((t, nh, v.shape[-1]))
    for c0 in range(0, t, chunk_size):
        c1 = min(t, c0 + chunk_size)
        n = c1 - c0
        qc, kc, vc = (x[c0:c1].transpose(0, 1) for x in (q, k, v))  # [NH, n, .]
        bc = beta[c0:c1].transpose(0, 1)  # [NH, n]
        gcum = g[c0:c1].transpose(0, 1).cumsum(dim=1)  # [NH, n, K]
        diff = gcum[:, :, None, :] - gcum[:, None, :, :]  # [NH, n(t), n(i), K]: G_t - G_i
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()  # i <= t
        decay = torch.exp(
            diff.masked_fill(~causal[None, :, :, None], float("-inf"))
        )  # <= 1, zero above
        a = torch.einsum("htc,hic,htic->hti", kc, kc, decay) * bc[:, :, None]
        a = a.masked_fill(~causal.tril(-1)[None], 0.0)  # keep i < t only
        eye = torch.eye(n, dtype=q.dtype, device=q.device)
        decay_s = torch.exp(gcum)  # [NH, n, K]
        rhs = bc[:, :, None] * (vc - torch.einsum("htc,hcv->htv", decay_s * kc, s))
        u = torch.linalg.solve_triangular(
            eye + a, rhs, upper=False, unitriangular=True
        )  # [NH, n, V]
        bq = torch.einsum("htc,hic,htic->hti", qc, kc, decay)  # zero above the diagonal
        out[c0:c1] = (torch.einsum("htc,hcv->htv", decay_s * qc, s) + bq @ u).transpose(0, 1)
        tail = torch.exp(gcum[:, -1:, :] - gcum)  # [NH, n, K]: e^(G_end - G_i)
        s = s * torch.exp(gcum[:, -1, :])[:, :, None] + torch.einsum("hic,hiv->hcv", tail * kc, u)
    return out, s
