"""Causal attention over a batch of sequence segments, each with its own cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltafind.models.ops.batch import Batch
from deltafind.models.ops.cpu_kernels import LAYER


def _decode_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query row per head, q [Hq, 1, D] over k, v [Hkv, L, D]: two batched matmuls and a softmax.

    PERF: SDPA's fused CPU kernel costs 2-3x this for one row (and much more when its threads
    wait on a shared machine); the arithmetic is the same up to summation order."""
    if (o := _decode_one_cpu(q, k, v, scale)) is not None:
        return o
    hkv, group = k.shape[0], q.shape[0] // k.shape[0]
    scores = torch.bmm(q.reshape(hkv, group, q.shape[-1]), k.transpose(1, 2)) * scale  # [Hkv, G, L]
    return torch.bmm(torch.softmax(scores, dim=-1), v).reshape(q.shape[0], 1, v.shape[-1])  # [Hq, 1, Dv]


def _decode_one_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor | None:
    """`_decode_one` in one kernel call (layer_cpu.cpp) for fp32 on the CPU with the cache contiguous in
    its [L, Hkv, D] buffer (k, v here are its [Hkv, L, D] transposed views); else None."""
    kb, vb = k.transpose(0, 1), v.transpose(0, 1)
    if (q.dtype != torch.float32 or q.device.type != "cpu" or not (kb.is_contiguous() and vb.is_contiguous())
            or k.dtype != torch.float32 or v.dtype != torch.float32 or q.shape[0] % kb.shape[1]
            or q.shape[-1] != kb.shape[2] or kb.shape[:2] != vb.shape[:2] or (lib := LAYER.load()) is None):
        return None
    qc = q.reshape(q.shape[0], q.shape[-1]).contiguous()  # [Hq, D]
    out = torch.empty(q.shape[0], 1, v.shape[-1])
    lib.df_attend_one(qc.data_ptr(), kb.data_ptr(), vb.data_ptr(), kb.shape[0], q.shape[0], kb.shape[1], q.shape[-1],
                      v.shape[-1], scale, out.data_ptr())
    return out


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: Batch,
    layer_idx: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Append k/v to each segment's cache and attend causally.

    q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, Dv] for the batch's new tokens.
    Returns [T, Hq, Dv].
    """
    out = q.new_empty((q.shape[0], q.shape[1], v.shape[-1]))
    for seg in batch.segments:
        sl = slice(seg.start, seg.start + seg.num_tokens)
        k_all, v_all = seg.cache.layers[layer_idx].append(k[sl], v[sl])  # [L, Hkv, D]
        qs = q[sl].transpose(0, 1)  # [Hq, n, D]
        ks, vs = k_all.transpose(0, 1), v_all.transpose(0, 1)  # [Hkv, L, D]
        n, total = seg.num_tokens, k_all.shape[0]
        if n == 1:
            out[sl] = _decode_one(qs, ks, vs, q.shape[-1] ** -0.5 if scale is None else scale).transpose(0, 1)
            continue
        mask = None
        if n > 1:
            # query i sits at absolute position total - n + i and sees keys 0..that position
            qpos = torch.arange(total - n, total, device=q.device)[:, None]
            mask = torch.arange(total, device=q.device)[None, :] <= qpos  # [n, L]
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=qs.shape[0] != ks.shape[0]
        )
        out[sl] = o.transpose(0, 1)
    return out
