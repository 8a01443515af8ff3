"""The per-layer step every family's forward runs: the model's whole side of the provider contract.

A family supplies each layer's attention and FFN halves; this calls the `ExpertProvider`
hooks around them in one order for all (the FFN's `moe.dispatch` reports routes and fetches).

`DecodeChain`: a one-token decode step's decoder layers in ONE kernel call (layer_cpu.cpp's
df_decode_layers), run first where it applies. The per-layer path makes two kernel calls a layer,
the attention half (`AttnStep`) and the MLP half (`GatedExpert.slices`), with the hooks and the
Python around them in between: on the demo that Python was ~17 % of a 2-thread token, and it does
not split across threads (tests/bench/RESULTS.md). Where every layer is such an attention step and a
dense MLP held resident (store/resident.py), and the hooks have nothing to do this step
(`ExpertProvider.held_chain`), the chain makes the same kernel calls with the same arguments in one
call: tokens and logits are bit-identical (tests/unit/test_decode_chain.py). Anything else (a batch,
a prompt, a draft's captured layers, a streamed spine, a trace, a routed layer, weights the kernels
do not take) runs the per-layer path.
"""

from __future__ import annotations

import ctypes
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from deltafind.log import get_logger
from deltafind.models.ops.attention import AttnStep
from deltafind.models.ops.batch import Batch, LayerCache
from deltafind.models.ops.cpu_kernels import CPU, DecodeLayer
from deltafind.provider import ExpertProvider

log = get_logger(__name__)
Chain = Callable[[torch.Tensor], tuple[torch.Tensor, int]]  # x -> (x after layers [0, done), done)


def run_layers(
    provider: ExpertProvider,
    batch: Batch,
    layers: Sequence[Any],
    x: torch.Tensor,
    first_hint: list[int] | None,
    attend: Callable[[int, Any, torch.Tensor], torch.Tensor],
    feed_forward: Callable[[int, Any, torch.Tensor], torch.Tensor],
    chain: Chain | None = None,
) -> torch.Tensor:
    """Run `layers` from hidden state x [T, H]; `attend(i, layer, x)` gives the state layer i+1
    predicts from (`predict_experts`), `feed_forward(i, layer, state)` the output `batch.capture` keeps;
    `chain(x)` (a family's `DecodeChain`) runs the first layers in one call where it applies."""
    layers = list(
        layers
    )  # a ModuleList's `layers[i]` and `len` cost ~2 us a layer (3.6 % of a demo token's Python)
    provider.begin_step(
        batch.token_sequences(), batch.positions.tolist()
    )  # traces name each token (drafts too)
    provider.prefetch(0, first_hint)
    x, start = chain(x) if chain is not None else (x, 0)
    for i in range(start, len(layers)):
        layer = layers[i]
        provider.enter_layer(i)  # a layer outside the resident spine prefix is read in
        state = attend(i, layer, x)
        if i + 1 < len(layers) and provider.wants_prefetch(i + 1):
            # While layer i's experts compute, layer i+1's predicted experts are read.
            provider.prefetch(i + 1, layers[i + 1].predict_experts(state))
        x = feed_forward(i, layer, state)
        if i in batch.capture:
            batch.captured[i] = x  # [T, H]; speculative drafts read it
    return x


class _Planned:
    """One layer count's kernel layers, with what their fixed fields were filled from: the parts arrays
    (held here, so the pointers stay valid), every weight slot of the layers and the held chain, and per
    layer the cache buffers last written into its fields."""

    __slots__ = ("bufs", "caches", "chain", "held", "keys", "likes", "slots", "steps", "weights")

    def __init__(self, steps: ctypes.Array, chain: Sequence[Any], n: int) -> None:
        self.steps, self.chain, self.held = steps, chain, [None] * n
        self.slots: list[Any] = []  # containers (a parameters dict, the chain) and their keys
        self.keys: list[Any] = []
        self.weights: list[Any] = []  # what each slot held when planned
        self.likes: list[torch.Tensor] = [
            torch.empty(0)
        ] * n  # one cache position: a new buffer's shape
        self.caches: list[Any] | None = (
            None  # the sequence's cache list whose rows are in the fields
        )
        self.bufs: list[Any] = [None] * n  # per layer, the buffer list its kbuf/vbuf point into

    def current(self, chain: Sequence[Any]) -> bool:
        """Whether every weight and held slice is the object it was planned with (one C-level pass)."""
        return chain is self.chain and all(
            map(operator.is_, map(operator.getitem, self.slots, self.keys), self.weights)
        )


class DecodeChain:
    """The chain of one model's decoder layers (`transformer.DecoderLayer`s, which say what each runs
    with: `chain_parts`). Planned once per layer count and set of weight objects (each step checks them
    by identity in one pass: re-planning every layer each step was ~0.1 ms of a ~13 ms demo token); each
    step writes only the cache rows."""

    def __init__(self) -> None:
        self._plans: dict[
            int, _Planned
        ] = {}  # by layer count (a layer-skip draft runs the first few)
        self.off = False  # a layer the kernels cannot take: fixed at open, so never tried again

    def __call__(
        self,
        layers: Sequence[Any],
        provider: ExpertProvider,
        x: torch.Tensor,
        batch: Batch,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, int]:
        """(the hidden state after layers [0, done), done) for x [1, H]: done = len(layers), or 0 where
        the chain does not apply (x as given)."""
        n = len(layers)
        if (
            self.off
            or not n
            or batch.capture
            or not AttnStep.takes(x, batch, cos, sin)
            or (chain := provider.held_chain(n)) is None
            or (lib := CPU.load()) is None
        ):
            return x, 0
        caches = batch.segments[0].cache.layers
        planned = self._plans.get(n)
        if planned is None or not planned.current(chain):
            planned = self._plans[n] = self._plan(layers, chain, caches, x.shape[1], cos.shape[-1])
        if planned is None or not self._rows(planned, caches):
            self._plans.pop(n, None)
            self.off = True  # the weights, the held layers and the kernels are fixed once open
            log.info("decode_chain_off", reason="a layer the chain cannot run")
            return x, 0
        out = x.clone()
        done = lib.df_decode_layers(
            planned.steps,
            n,
            cos.data_ptr(),
            sin.data_ptr(),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        for i in range(done):
            caches[i].length += 1
            provider.dense_held(i)  # their use, counted as the per-layer path counts it
        # a part the planning took but the kernel did not: the per-layer path goes on from there
        if done < n:
            self.off = True
            log.warning("decode_chain_off", layer=done, reason="the kernel refused a part")
        return out, done

    @staticmethod
    def _plan(
        layers: Sequence[Any], chain: Sequence[Any], caches: Sequence[Any], cols: int, d: int
    ) -> _Planned | None:
        """Every layer's fixed fields (its attention plan, MLP parts and norm), or None where a layer
        does not take the kernels."""
        n = len(layers)
        planned = _Planned((DecodeLayer * n)(), chain, n)
        for i, layer in enumerate(layers):
            if (got := layer.chain_parts(chain[i], caches, cols, d)) is None:
                return None
            attn, parts, norm, act, (_, kbuf, _) = got
            s = planned.steps[i]
            s.attn, s.gu, s.down, s.n_gu, s.n_down = (
                ctypes.pointer(attn),
                ctypes.addressof(parts[0]),
                ctypes.addressof(parts[1]),
                len(parts[0]),
                len(parts[1]),
            )
            s.norm, s.eps, s.act = norm._parameters["weight"].data_ptr(), norm.eps, act
            planned.held[i] = (attn, parts)
            planned.likes[i] = kbuf.new_empty((1, *kbuf.shape[1:]))
            for container, key in [*layer.weight_slots(), (chain, i)]:
                planned.slots.append(container)
                planned.keys.append(key)
        planned.weights = list(map(operator.getitem, planned.slots, planned.keys))
        return planned

    @staticmethod
    def _rows(planned: _Planned, caches: list[Any]) -> bool:
        """Room for one more row in each layer's cache, its k/v buffers and length in the layer's fields;
        False where a cache is not one the kernel writes (fp32, contiguous `LayerCache` buffers)."""
        n = len(planned.steps)
        if caches is not planned.caches:  # another sequence: its buffers are all new to the fields
            if len(caches) < n or not all(type(c) is LayerCache for c in caches[:n]):
                return False
            planned.caches, planned.bufs = caches, [None] * n
        seen, likes = planned.bufs, planned.likes
        for i, s in enumerate(planned.steps):
            cache = caches[i]
            like = likes[i]
            if (bufs := cache.reserve(1, like, like)) is not seen[i]:
                kbuf, vbuf = bufs
                if kbuf.dtype != torch.float32 or not (
                    kbuf.is_contiguous() and vbuf.is_contiguous()
                ):
                    return False
                s.kbuf, s.vbuf, seen[i] = kbuf.data_ptr(), vbuf.data_ptr(), bufs
            s.len = cache.length
        return True
