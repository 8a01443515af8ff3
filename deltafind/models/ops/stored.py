"""Matmul on weights in the format they are stored in: bf16, fp16 and GGUF block formats.

A `StoredWeight` (stored_weight.py) is a logical [rows, cols] matrix kept as its stored bytes: a bf16/fp16
tensor, or uint8 [rows, row_bytes] of llama.cpp blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
Q2_K..Q6_K and the IQ formats: IQ1_S/M, IQ2_XXS/XS/S, IQ3_XXS/S, IQ4_NL/XS). `stored_linear(x, w)` computes `x @ W.T` with fp32 activations and
fp32 accumulation, every weight decoded exactly as the fp32-widened path decodes it
(bf16/fp16: the exact widening; GGUF: gguf-py's `dequantize`, the import's oracle):
on the CPU through stored_cpu.cpp, elsewhere (or without a compiler) by decoding into
a scratch matrix and one BLAS matmul. Results equal the widened path within fp32
summation-order noise.
"""

from __future__ import annotations

import contextlib
import ctypes
import weakref
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F

from deltafind.models.ops import fast_math
from deltafind.models.ops.cpu_kernels import StoredPart
from deltafind.models.ops.stored_weight import (
    KINDS,
    TORCH_KINDS,
    StoredWeight,
    dequantize,
    kernel_ok,
    to_row_int8,
)

INT8_SKIP = (
    "conv1d",
    "norm",
    "A_log",
    "dt_bias",
    "res_proj",
    "e_score_correction_bias",
    ".experts.",
    "vision",
    "mm_projector",
)


def int8_spine(net: torch.nn.Module) -> int:
    """Convert every float Linear/Embedding matrix docs/kimi-k3-drafting-io.md §9.6 names to row-int8 in place (opt-in; NOT
    weight-exact: the logits drift, see tests/bench/bench_int8_spine.py). Returns bytes saved.
    Weights not yet loaded (a streamed spine's later layers) stay as stored."""
    saved, done = 0, {}  # id(weight) -> (int8 parameter, tag): a tied head shares its embedding's
    for name, m in net.named_modules():
        if getattr(m, "weight", None) is not None and id(m.weight) in done:
            as_stored(m).weight, m.quant = done[id(m.weight)]
            continue
        weight = getattr(m, "weight", None)
        if (
            not isinstance(m, (torch.nn.Linear, torch.nn.Embedding))
            or weight is None
            or weight.device.type == "meta"
            or any(s in f"{name}.weight" for s in INT8_SKIP)
            or getattr(m, "quant", "").startswith("I8R/")
        ):
            continue
        if (
            getattr(m, "quant", "")
            or weight.dim() != 2
            or not weight.is_floating_point()
            or weight.shape[1] % 32
        ):
            continue  # GGUF blocks are already smaller than int8: only float matrices convert
        before = weight.numel() * weight.element_size()
        as_stored(m).weight = torch.nn.Parameter(to_row_int8(weight), requires_grad=False)
        m.quant = f"I8R/{weight.shape[1]}"
        done[id(weight)] = (m.weight, m.quant)
        saved += before - m.weight.numel()
    return saved


def _part(w: StoredWeight) -> StoredPart:
    return StoredPart(
        KINDS[w.kind], w.rows, w.cols, w.data.shape[1] * w.data.element_size(), w.data.data_ptr()
    )


def _run_parts(
    parts: ctypes.Array, stack_cols: bool, x: torch.Tensor, out_cols: int
) -> torch.Tensor | None:
    """One `df_stored_parts` call: x [T, in] fp32 contiguous -> y [T, out_cols]; None if the kernel refused.
    Prefill rows under the opt-in `[device] math = "bf16"` take its kernel instead (fast_math.py)."""
    y = torch.empty(x.shape[0], out_cols, dtype=torch.float32)
    rc = fast_math.run(
        x,
        "df_stored_parts",
        parts,
        len(parts),
        int(stack_cols),
        x.data_ptr(),
        x.shape[0],
        x.shape[1],
        y.data_ptr(),
        out_cols,
        torch.get_num_threads(),
    )
    return y if rc == 0 else None


def stored_linear(
    x: torch.Tensor, w: StoredWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`x @ W.T (+ bias)` for fp32 `x` [..., cols]: fp32 out [..., rows], weights read in their stored format."""
    if x.dtype != torch.float32 or not (x.device.type == "cpu" and kernel_ok(w)):
        return F.linear(x, dequantize(w).to(x.dtype), bias)
    lead = x.shape[:-1]
    y = _run_parts((StoredPart * 1)(_part(w)), False, x.reshape(-1, w.cols).contiguous(), w.rows)
    if y is None:
        return F.linear(x, dequantize(w), bias)
    if bias is not None:
        y += bias
    return y.reshape(*lead, w.rows)


class FusedLinear:
    """`x @ W.T` in ONE kernel call for W built from several stored matrices without copying them:
    their rows stacked (q/k/v; every slice's gate then up), or side by side (`stack_cols`: a dense
    MLP's down slices, x's columns following the parts). Planned once, rebuilt when any weight object
    changes; holds the weights weakly, so it never keeps an evicted expert or old spine layer alive.
    `__call__` returns None where the kernel does not apply (GPU, non-fp32 x, widened or MXFP4
    weights, no compiler): the caller then runs its per-matrix path, which is the oracle.
    """

    def __init__(self, stack_cols: bool = False) -> None:
        self.stack_cols = stack_cols
        self._refs: tuple[weakref.ref, ...] = ()
        self._parts: ctypes.Array | None = None
        self.in_cols = self.out_cols = 0

    def _plan(self, weights: Sequence[torch.Tensor], quants: Sequence[str]) -> None:
        self._refs, self._parts = tuple(weakref.ref(w) for w in weights), None
        if _widen:
            return
        try:
            ws = [
                StoredWeight.tagged(w, q) if q else StoredWeight.of(w)
                for w, q in zip(weights, quants, strict=True)
            ]
        except ValueError:
            return  # fp32 or packed weights: not for this kernel
        if (
            not all(kernel_ok(w) for w in ws)
            or len({w.rows if self.stack_cols else w.cols for w in ws}) != 1
        ):
            return
        self._parts = (StoredPart * len(ws))(*map(_part, ws))
        rows, cols = [w.rows for w in ws], [w.cols for w in ws]
        self.in_cols, self.out_cols = (
            (sum(cols), rows[0]) if self.stack_cols else (cols[0], sum(rows))
        )

    def parts(self, weights: Sequence[torch.Tensor], quants: Sequence[str]) -> ctypes.Array | None:
        """The kernel's parts for these weights (planned again if any changed), or None where it does
        not apply; `in_cols`/`out_cols` are then W's shape. The fused layer kernels take them too."""
        refs = self._refs
        if len(refs) != len(weights) or any(
            r() is not w for r, w in zip(refs, weights, strict=True)
        ):
            self._plan(weights, quants)
        return self._parts

    @property
    def parts_planned(self) -> ctypes.Array | None:
        """The parts of the last `parts` call, not checked again (the caller just did)."""
        return self._parts

    def run(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [T, in] -> [T, out] fp32 with the weights planned last, or None (see the class)."""
        if (
            self._parts is None
            or x.dtype != torch.float32
            or x.device.type != "cpu"
            or x.shape[-1] != self.in_cols
        ):
            return None
        return _run_parts(self._parts, self.stack_cols, x.contiguous(), self.out_cols)

    def __call__(
        self, x: torch.Tensor, weights: Sequence[torch.Tensor], quants: Sequence[str]
    ) -> torch.Tensor | None:
        """x [T, in] -> [T, out] fp32, or None (see the class)."""
        self.parts(weights, quants)
        return self.run(x)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, quant: str = ""
) -> torch.Tensor:
    """`F.linear` for a weight in any stored format: GGUF blocks (`quant` tag) and bf16/fp16 under
    fp32 activations are computed on as stored; otherwise the weight takes the activations' dtype."""
    if quant:
        w = StoredWeight.tagged(weight, quant)
        return F.linear(x, dequantize(w).to(x.dtype), bias) if _widen else stored_linear(x, w, bias)
    if weight.dtype == x.dtype:
        return F.linear(x, weight, bias)
    if x.dtype == torch.float32 and weight.dtype in TORCH_KINDS:
        return stored_linear(x, StoredWeight.of(weight), bias)
    return F.linear(x, weight.to(x.dtype), bias)


def hold_dtype(stored: set[torch.dtype], compute: torch.dtype) -> torch.dtype:
    """The dtype to hold float weights stored as `stored` in: as stored when they are all one
    half-precision dtype and compute is fp32 (and not `widened()`), else the compute dtype."""
    floats = {d for d in stored if d.is_floating_point}
    if (
        not _widen
        and compute == torch.float32
        and len(floats) == 1
        and next(iter(floats)) in TORCH_KINDS
    ):
        return next(iter(floats))
    return compute


class StoredLinear(torch.nn.Linear):
    """An `nn.Linear` whose weight stays as stored (bf16/fp16, or GGUF blocks / row-int8 tagged `quant`)."""

    quant = ""  # the weight's store tag (store/quant.py); "" for a float matrix
    _fused: FusedLinear | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fused is None:
            self._fused = FusedLinear()
        if x.dim() == 2 and (y := self._fused(x, (self.weight,), (self.quant,))) is not None:
            return y if self.bias is None else y + self.bias
        return linear(x, self.weight, self.bias, self.quant)


class StoredEmbedding(torch.nn.Embedding):
    """An `nn.Embedding` whose table stays as stored: looked-up rows are decoded exactly."""

    compute_dtype = torch.float32
    quant = ""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant:
            rows = StoredWeight.tagged(self.weight[ids.reshape(-1)], self.quant)
            return dequantize(rows).reshape(*ids.shape, rows.cols).to(self.compute_dtype)
        return super().forward(ids).to(self.compute_dtype)


def install_quantized(
    net: torch.nn.Module, quants: dict[str, str], tensors: dict[str, torch.Tensor]
) -> None:
    """Give the modules of GGUF-block weights (`quants`: name -> tag) their tags, and the loaded ones
    their blocks (`tensors`; weights streamed in later arrive through store/spine.py)."""
    for name, tag in quants.items():
        module_name, _, leaf = name.rpartition(".")
        module = net.get_submodule(module_name)
        if leaf != "weight" or not isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            raise ValueError(f"{name}: GGUF blocks are only kept for Linear and Embedding weights")
        if _widen:  # the oracle path: decoded to fp32 at load, as format 1 stores did at import
            if name in tensors:
                module.weight = torch.nn.Parameter(
                    dequantize(StoredWeight.tagged(tensors[name], tag)), requires_grad=False
                )
            continue
        as_stored(module).quant = tag
        if name in tensors:
            module.weight = torch.nn.Parameter(tensors[name], requires_grad=False)


_widen = False  # set by `widened()`


@contextlib.contextmanager
def widened() -> Iterator[None]:
    """Open models with every weight widened to the compute dtype: the exactness oracle."""
    global _widen
    old, _widen = _widen, True
    try:
        yield
    finally:
        _widen = old


def stored_weight_names(net: torch.nn.Module) -> set[str]:
    """Weights of the net's Linear and Embedding modules: the ones it can compute on as stored."""
    if _widen:
        return set()
    return {
        f"{name}.weight"
        for name, m in net.named_modules()
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))
    }


def adopt_stored(net: torch.nn.Module, compute: torch.dtype) -> int:
    """Let every Linear/Embedding compute on its weight as stored (bf16/fp16 under fp32 activations).

    All of them, loaded or not: spine layers streamed in later (store/spine.py) arrive in their
    stored dtype too. A weight already in `compute` dtype runs the plain op. Exact: the widened
    path's weights are these weights widened. Returns how many modules changed.
    """
    if _widen:
        return 0
    changed = 0
    tags = {id(m.weight): m.quant for m in net.modules() if getattr(m, "quant", "")}
    for m in net.modules():
        if not isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            continue
        if id(m.weight) in tags:
            as_stored(m).quant = tags[id(m.weight)]  # a head tied to a block-stored embedding
        if isinstance(as_stored(m), StoredEmbedding):
            m.compute_dtype = compute
        changed += 1
    return changed


def as_stored(m: torch.nn.Module) -> StoredLinear | StoredEmbedding:
    """`m` (a Linear or Embedding) as its stored-weight type, in place: the one place a weight's tag is
    declared on (the families built plain torch modules, and keep references to them)."""
    m.__class__ = StoredLinear if isinstance(m, torch.nn.Linear) else StoredEmbedding
    return m  # type: ignore[return-value]
