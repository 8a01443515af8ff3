"""What an import makes of a checkpoint's tensors: the spine, routed expert records, and dense MLPs
cut into slices (`Plan`, by the family's weight names), and each record's tensors in store order.

importer/setup.py (a local import) and importer/hub_streaming.py (a hub's) write what this plans.
"""

from __future__ import annotations

import re
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from deltafind.errors import StoreError
from deltafind.importer.sources import Source, TensorInfo
from deltafind.log import get_logger
from deltafind.provider import HF_WEIGHTS, WeightNames
from deltafind.store.quant import BLOCKS, parse_quant, slice_cols

log = get_logger(__name__)
EXPERT_NAME = re.compile(
    r"\.experts\.\d+\."
)  # how any family's routed experts read; never spine tensors
Parts = tuple[
    dict[str, torch.Tensor], dict[str, str]
]  # a record's tensors, and quant tags (store/quant.py)


@dataclass(frozen=True)
class Plan:
    spine: list[str]
    routed: dict[
        tuple[int, int], dict[str, str]
    ]  # (layer, expert) -> part -> tensor name, in record order
    dense: dict[int, dict[str, str]]  # layer -> part -> tensor name (sliced into N experts)


def plan_tensors(tensors: dict[str, TensorInfo], names: WeightNames = HF_WEIGHTS) -> Plan:
    """Sort a checkpoint's tensors into spine, routed experts and dense MLPs by the family's `names`."""
    kept = names.sanitize(tensors)
    if len(kept) < len(tensors):
        dropped = sorted(set(tensors) - set(kept))
        log.warning(
            "setup_skipped_tensors",
            count=len(dropped),
            first=dropped[:3],
            why="the family's sanitize drops them",
        )
    spine, routed, dense = [], {}, {}
    for name in kept:
        if m := names.routed.fullmatch(name):
            routed.setdefault((int(m[1]), int(m[2])), {})[m[3]] = name
        elif m := names.dense.fullmatch(name):
            dense.setdefault(int(m[1]), {})[m[2]] = name
        elif EXPERT_NAME.search(name):
            raise StoreError(
                f"{name}: an expert tensor the family's weight names do not claim; import with the "
                "family's names (`deltafind setup` passes them; setup_store(names=...))"
            )
        else:
            spine.append(name)
    for key, parts in {**routed, **{(k, -1): v for k, v in dense.items()}}.items():
        layout = next((lay for lay in names.layouts if set(parts) == set(lay)), None)
        if layout is None:
            raise StoreError(
                f"layer {key[0]}: expert tensors incomplete, found only {sorted(parts)}"
            )
        (routed if key[1] >= 0 else dense)[key if key[1] >= 0 else key[0]] = {
            p: parts[p] for p in layout
        }
    for (layer, expert), parts in routed.items():
        _check_mxfp4(layer, expert, {p: tensors[n] for p, n in parts.items()})
    return Plan(spine, routed, dense)


def _check_mxfp4(layer: int, expert: int, parts: dict[str, TensorInfo]) -> None:
    """MXFP4 packs must be uint8 and shaped [R, C/2] + [R, C/32], as compressed-tensors writes them."""
    for name in [p.removesuffix(".weight_packed") for p in parts if p.endswith(".weight_packed")]:
        packed, scale = parts[f"{name}.weight_packed"], parts.get(f"{name}.weight_scale")
        ok = (
            scale is not None
            and packed.dtype == scale.dtype == torch.uint8
            and len(packed.shape) == len(scale.shape) == 2
        )
        if (
            not ok
            or scale.shape != (packed.shape[0], packed.shape[1] * 2 // 32)
            or (packed.shape[1] * 2) % 32
        ):
            got = "no scale" if scale is None else f"scale {scale.dtype}{list(scale.shape)}"
            raise StoreError(
                f"layer {layer} expert {expert} {name}: MXFP4 pack {packed.dtype}{list(packed.shape)} with {got} "
                "is not a compressed-tensors mxfp4-pack-quantized pair; re-download the checkpoint"
            )


def iter_expert_groups(
    source: Source, plan: Plan, dense_slices: int
) -> Iterator[tuple[int, int, Callable[[], Parts]]]:
    """(layer, expert, loader) in store order; dense layers yield `dense_slices` slices.

    A loader gives the record's tensors and the quant tags of those kept as GGUF blocks.
    """
    layers = sorted({k[0] for k in plan.routed} | set(plan.dense))
    for layer in layers:
        if layer in plan.dense:
            names = plan.dense[layer]
            cache: dict[str, list[tuple[torch.Tensor, str]]] = {}
            served: list[int] = []
            lock = threading.Lock()

            def load_slice(
                i: int,
                names: dict[str, str] = names,
                cache: dict = cache,
                served: list[int] = served,
                lock: threading.Lock = lock,
            ) -> Parts:
                with lock:  # slices may load on several threads (importer/setup.py)
                    if not cache:  # load the layer's MLP once, slice it N ways
                        for part, name in names.items():
                            cache[part] = _split(
                                source.load(name),
                                source.tensors[name].quant,
                                dense_slices,
                                part == "down_proj",
                            )
                    out = {part: cache[part][i] for part in names}
                    served.append(i)
                    if len(served) == dense_slices:  # every slice taken, in whatever order
                        cache.clear()
                return {p: t for p, (t, _) in out.items()}, {p: q for p, (_, q) in out.items() if q}

            for i in range(dense_slices):
                yield layer, i, lambda i=i, f=load_slice: f(i)
        for layer_idx, expert in sorted(k for k in plan.routed if k[0] == layer):
            names = plan.routed[(layer_idx, expert)]
            yield (
                layer,
                expert,
                lambda names=names: (
                    {p: source.load(n) for p, n in names.items()},
                    {
                        p: source.tensors[n].quant
                        for p, n in names.items()
                        if source.tensors[n].quant
                    },
                ),
            )


class Durable:
    """Which checkpoint tensors have every record made from them written and journaled (a dense MLP
    makes `dense_slices` records), so a source may free them (`Source.durable`)."""

    def __init__(self, plan: Plan, dense_slices: int) -> None:
        self.parts = {key: list(names.values()) for key, names in plan.routed.items()}
        for layer, names in plan.dense.items():
            self.parts.update({(layer, i): list(names.values()) for i in range(dense_slices)})
        self.left = Counter(n for names in self.parts.values() for n in names)  # records per tensor

    def names(self) -> list[str]:
        return list(self.left)

    def add(self, keys: list[tuple[int, int]]) -> list[str]:
        """Mark the records `keys` durable; the tensors that leaves with no record to wait for."""
        out = []
        for key in keys:
            for n in self.parts[key]:
                self.left[n] -= 1
                if self.left[n] == 0:
                    out.append(n)
        return out


DENSE_SLICE_BYTES = (
    8 << 20
)  # the least bytes of a dense slice when the count is chosen (`dense_slices_for`)
MAX_DENSE_SLICES = 8


def dense_slices_for(tensors: dict[str, TensorInfo], plan: Plan, asked: int | None) -> int:
    """`asked`, or (None) as many slices per dense MLP as keep each at least DENSE_SLICE_BYTES, at most
    MAX_DENSE_SLICES, on whole GGUF blocks. Every slice is a record: fetched, planned and dotted as a
    part of its own, so small ones cost per token (the demo's 1.7 MB MLPs in 8 slices of 0.2 MB decoded
    ~10 % slower than whole, tests/bench/RESULTS.md); a layer still spans every drive by striping."""
    if asked is not None:
        if asked < 1:
            raise StoreError(f"dense slices must be >= 1 (got {asked})")
        return asked
    if not plan.dense:
        return 1
    parts = {p: tensors[n] for p, n in next(iter(plan.dense.values())).items()}
    n = max(1, min(MAX_DENSE_SLICES, sum(t.nbytes for t in parts.values()) // DENSE_SLICE_BYTES))
    down = parts.get("down_proj")
    if down is not None and down.quant:  # down slices are cut at block boundaries
        kind, cols = parse_quant(down.quant)
        while n > 1 and cols % (n * BLOCKS[kind][0]):
            n -= 1
    return n


def _split(t: torch.Tensor, tag: str, n: int, by_cols: bool) -> list[tuple[torch.Tensor, str]]:
    """`t` cut into n slices (rows, or columns for down_proj) as torch.tensor_split cuts; GGUF blocks
    are cut at block boundaries with each slice's tag."""
    if not tag or not by_cols:
        return [(x, tag) for x in torch.tensor_split(t, n, dim=1 if by_cols else 0)]
    _, cols = parse_quant(tag)
    bounds = [(int(c[0]), int(c[-1]) + 1) for c in torch.tensor_split(torch.arange(cols), n)]
    return [slice_cols(t, tag, a, b) for a, b in bounds]
