"""Causal attention over a batch of sequence segments, each with its own cache."""

from __future__ import annotations

import ctypes
import operator
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from deltafind.models.ops.batch import Batch, LayerCache
from deltafind.models.ops.cpu_kernels import CPU, AttnLayer
from deltafind.models.ops.stored import FusedLinear


def _decode_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query row per head, q [Hq, 1, D] over k, v [Hkv, L, D]: two batched matmuls and a softmax.

    PERF: SDPA's fused CPU kernel costs 2-3x this for one row (and much more when its threads
    wait on a shared machine); the arithmetic is the same up to summation order."""
    if (o := _decode_one_cpu(q, k, v, scale)) is not None:
        return o
    hkv, group = k.shape[0], q.shape[0] // k.shape[0]
    scores = torch.bmm(q.reshape(hkv, group, q.shape[-1]), k.transpose(1, 2)) * scale  # [Hkv, G, L]
    return torch.bmm(torch.softmax(scores, dim=-1), v).reshape(
        q.shape[0], 1, v.shape[-1]
    )  # [Hq, 1, Dv]


def _decode_one_cpu(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor | None:
    """`_decode_one` in one kernel call (layer_cpu.cpp) for fp32 on the CPU with the cache contiguous in
    its [L, Hkv, D] buffer (k, v here are its [Hkv, L, D] transposed views); else None."""
    kb, vb = k.transpose(0, 1), v.transpose(0, 1)
    if (
        q.dtype != torch.float32
        or q.device.type != "cpu"
        or not (kb.is_contiguous() and vb.is_contiguous())
        or k.dtype != torch.float32
        or v.dtype != torch.float32
        or q.shape[0] % kb.shape[1]
        or q.shape[-1] != kb.shape[2]
        or kb.shape[:2] != vb.shape[:2]
        or (lib := CPU.load()) is None
    ):
        return None
    qc = q.reshape(q.shape[0], q.shape[-1]).contiguous()  # [Hq, D]
    out = torch.empty(q.shape[0], 1, v.shape[-1])
    lib.df_attend_one(
        qc.data_ptr(),
        kb.data_ptr(),
        vb.data_ptr(),
        kb.shape[0],
        q.shape[0],
        kb.shape[1],
        q.shape[-1],
        v.shape[-1],
        scale,
        out.data_ptr(),
    )
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
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    for seg in batch.segments:
        sl = slice(seg.start, seg.start + seg.num_tokens)
        k_all, v_all = seg.cache.layers[layer_idx].append(k[sl], v[sl])  # [L, Hkv, D]
        qs = q[sl].transpose(0, 1)  # [Hq, n, D]
        ks, vs = k_all.transpose(0, 1), v_all.transpose(0, 1)  # [Hkv, L, D]
        attn = _decode_one if seg.num_tokens == 1 else causal_attention
        out[sl] = attn(qs, ks, vs, scale).transpose(0, 1)
    return out


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Rows q [Hq, n, D], the last n positions of k [Hkv, L, D] and v [Hkv, L, Dv], each seeing keys up to
    its own position -> [Hq, n, Dv], in memory linear in L: no [n, L] score or mask is ever made.

    On the CPU torch's flash kernel (fp32 online softmax over key blocks) does it; its causal flag aligns
    the diagonal top-left, so with cached keys before the rows (a chunk, a reused prefix, a verify pass)
    the cached part (no mask) and the new part (causal) are separate passes merged by their log-sum-exp."""
    n, total, dv = q.shape[1], k.shape[1], v.shape[-1]
    if n == 0:  # the flash kernel divides by the row count (SIGFPE): no rows, nothing to attend
        return q.new_empty((q.shape[0], 0, dv))
    q, k, v = (
        q[None],
        k[None],
        v[None],
    )  # [1, H, ., D]: SDPA picks a fused kernel for 4-d inputs only
    if q.device.type != "cpu":
        # a lower-right causal bias, which CUDA's memory-efficient kernel applies without a mask tensor
        o = F.scaled_dot_product_attention(
            q,
            k,
            _widen(v, q),
            attn_mask=causal_lower_right(n, total),
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return o[0, ..., :dv]
    cached = total - n
    # MLA's v is narrower than its q.k and the kernel wants one width: the cached part is widened a block
    # of keys at a time, so a verify pass after a long context copies a block, not the whole cache.
    step = max(cached, 1) if dv == q.shape[-1] else KEY_BLOCK
    o_acc, lse_acc = _flash_cpu(
        q, k[:, :, cached:], _widen(v[:, :, cached:], q), True, scale
    )  # the rows' own keys
    for s in range(0, cached, step):
        e = min(s + step, cached)
        o, lse = _flash_cpu(
            q, k[:, :, s:e], _widen(v[:, :, s:e], q), False, scale
        )  # every cached key
        both = torch.logaddexp(lse_acc, lse)  # [1, Hq, n]
        o_acc = (
            o_acc.float() * torch.exp(lse_acc - both)[..., None]
            + o.float() * torch.exp(lse - both)[..., None]
        )
        lse_acc = both
    return o_acc[0, ..., :dv].to(q.dtype)


KEY_BLOCK = 4096  # cached keys widened at once where v is narrower than q.k


def _widen(v: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """v [..., Dv] zero-padded to q's width D (the output's extra columns are dropped), or v itself."""
    return v if v.shape[-1] == q.shape[-1] else F.pad(v, (0, q.shape[-1] - v.shape[-1]))


def _flash_cpu(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [1, Hq, n, D], log-sum-exp [1, Hq, n]) of torch's CPU flash attention (what SDPA runs for
    4-d CPU inputs, grouped heads included); the public SDPA does not return the log-sum-exp."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, scale=scale
    )


class AttnStep:
    """The attention half of a decoder layer, `x + attn(norm(x))`, for ONE token of one sequence in one
    kernel call (layer_cpu.cpp's df_attn_decode): norm, q/k/v, q/k norms, rope, the cache append,
    attention, o and the residual, the per-op path's ops in its order (tests/unit/test_fused_steps.py).
    `attn` is a transformer.Attention, `norm` its RMSNorm. Planned once per set of weight objects (a
    reloaded spine layer brings new ones); `__call__` returns None where it does not apply (a batch, a
    prompt, another device or dtype, weights the stored-format kernel does not take, no compiler)."""

    def __init__(self, norm: Any, attn: Any) -> None:
        self.norm, self.attn = norm, attn
        mods = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)
        # Where each weight lives: checked by identity on every call (a dict lookup each, where a
        # module attribute costs ~1 us), held weakly in `_key`.
        self._slots = [
            *((m._parameters, "weight") for m in mods),
            (norm._parameters, "weight"),
            *((m._parameters, "bias") for m in mods),
            *(
                ((attn.q_norm._parameters, "weight"), (attn.k_norm._parameters, "weight"))
                if attn.qk_norm
                else ()
            ),
        ]
        self._mods = mods
        self._qkv, self._o = FusedLinear(), FusedLinear()
        self._key: list[weakref.ref | _NoRef] = []
        self._layer: AttnLayer | None = None
        self._layer_ref: Any = None  # ctypes.byref(_layer)
        self._layer_idx = attn.layer_idx
        self._like: torch.Tensor | None = (
            None  # one position of the cache: the shape a new buffer takes
        )
        self._held: tuple[Any, ...] = ()  # the small tensors the plan points at

    @staticmethod
    def takes(x: torch.Tensor, batch: Batch, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """Whether the step is one this kernel runs: one token x [1, H] of one sequence, fp32 on the CPU,
        contiguous, with fp32 contiguous rope tables (ops/step.py's DecodeChain asks it too)."""
        return (
            len(batch.segments) == 1
            and x.dtype == torch.float32
            and x.is_cpu
            and x.is_contiguous()
            and x.shape[0] == 1
            and cos.dtype == torch.float32
            and cos.is_contiguous()
            and sin.is_contiguous()
        )

    def __call__(
        self, x: torch.Tensor, batch: Batch, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor | None:
        """x [1, H] -> x + attn(norm(x)) [1, H], or None (see the class)."""
        if (
            not self.takes(x, batch, cos, sin)
            or (layer := self.plan()) is None
            or cos.shape[-1] != layer.d
        ):
            return None
        if (row := self.cache_row(batch.segments[0].cache.layers)) is None:
            return None
        cache, kbuf, vbuf = row
        out = torch.empty(1, x.shape[1])
        if CPU.load().df_attn_decode(
            self._layer_ref,
            x.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            kbuf.data_ptr(),
            vbuf.data_ptr(),
            cache.length,
            out.data_ptr(),
            torch.get_num_threads(),
        ):
            return None  # nothing was appended: row `length` is past the cache's end
        cache.length += 1
        return out

    def cache_row(
        self, caches: Sequence[Any]
    ) -> tuple[LayerCache, torch.Tensor, torch.Tensor] | None:
        """This layer's cache among a sequence's `caches`, with room made for one more row, and its k and v
        buffers, where the kernel can write that row (fp32, contiguous); else None."""
        cache = caches[self._layer_idx]
        if not isinstance(cache, LayerCache):
            return None
        kbuf, vbuf = cache.reserve(1, self._like, self._like)
        if kbuf.dtype != torch.float32 or not (kbuf.is_contiguous() and vbuf.is_contiguous()):
            return None
        return cache, kbuf, vbuf

    def plan(self) -> AttnLayer | None:
        """The kernel's layer (re-planned when a weight object changed), or None where it does not apply."""
        weights = [d[k] for d, k in self._slots]
        if len(weights) == len(self._key) and all(
            map(operator.is_, [r() for r in self._key], weights)
        ):
            return self._layer
        self._key, self._layer, self._layer_ref = [_ref(w) for w in weights], None, None
        attn, norm = self.attn, self.norm
        quants = [
            getattr(m, "quant", "") for m in self._mods
        ]  # GGUF tags arrive after the layer is built
        qkv = self._qkv.parts(weights[:3], quants[:3])
        o = self._o.parts(weights[3:4], quants[3:])
        h, hq, hkv, d = weights[4].shape[0], attn.num_heads, attn.num_kv_heads, attn.head_dim
        small = [w for w in weights[4:] if w is not None]
        if (
            qkv is None
            or o is None
            or h % 8
            or d % 8
            or any(
                t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous()
                for t in small
            )
            or (self._qkv.in_cols, self._qkv.out_cols, self._o.in_cols, self._o.out_cols)
            != (h, (hq + 2 * hkv) * d, hq * d, h)
        ):
            return None
        qkv_bias = torch.cat(weights[5:8]) if weights[5] is not None else None

        def ptr(t: torch.Tensor | None) -> int | None:
            return None if t is None else t.data_ptr()

        q_norm, k_norm = weights[9:11] if attn.qk_norm else (None, None)
        self._held = (small, qkv_bias)  # the pointers below stay valid while the plan lives
        self._like = torch.empty(1, hkv, d)
        self._layer = layer = AttnLayer(
            ctypes.addressof(qkv),
            ctypes.addressof(o),
            len(qkv),
            len(o),
            ptr(weights[4]),
            ptr(qkv_bias),
            ptr(weights[8]),
            ptr(q_norm),
            ptr(k_norm),
            h,
            hq,
            hkv,
            d,
            norm.eps,
            attn.q_norm.eps if attn.qk_norm else 0.0,
            d**-0.5,
        )
        self._layer_ref = ctypes.byref(
            layer
        )  # made once: df_attn_decode's first argument on every call
        return layer


class _NoRef:
    """`weakref.ref` of None: a missing bias compares as None."""

    def __call__(self) -> None:
        return None


def _ref(t: torch.Tensor | None) -> weakref.ref | _NoRef:
    return _NoRef() if t is None else weakref.ref(t)
