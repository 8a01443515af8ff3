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
from collections.abc import Callable, Sequence
from typing import Any

import torch

from deltafind.log import get_logger
from deltafind.models.ops.attention import AttnStep
from deltafind.models.ops.batch import Batch
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
        if i + 1 < len(layers):
            # While layer i's experts compute, layer i+1's predicted experts are read.
            provider.prefetch(i + 1, layers[i + 1].predict_experts(state))
        x = feed_forward(i, layer, state)
        if i in batch.capture:
            batch.captured[i] = x  # [T, H]; speculative drafts read it
    return x


class DecodeChain:
    """The chain of one model's decoder layers (`transformer.DecoderLayer`s, which say what each runs
    with: `chain_parts`). Each layer's fixed fields (its attention plan, MLP parts and norm) are filled
    when those objects change; its cache row each step."""

    def __init__(self) -> None:
        # by layer count (a layer-skip draft runs the first few): a DecodeLayer per layer, and per layer
        # the (AttnLayer, gate/up parts) its fixed fields were filled from
        self._arrays: dict[int, tuple[ctypes.Array, list[tuple[Any, Any] | None]]] = {}
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
        if (arrays := self._arrays.get(n)) is None:
            arrays = self._arrays[n] = ((DecodeLayer * n)(), [None] * n)
        (steps, keys), caches, cols, d = (
            arrays,
            batch.segments[0].cache.layers,
            x.shape[1],
            cos.shape[-1],
        )
        rows = []
        for i, layer in enumerate(layers):
            if (got := layer.chain_parts(chain[i], caches, cols, d)) is None:
                self.off = True  # the weights, the held layers and the kernels are fixed once open
                log.info("decode_chain_off", layer=i, reason="a layer the chain cannot run")
                return x, 0
            attn, parts, norm, act, (cache, kbuf, vbuf) = got
            s = steps[i]
            if (key := keys[i]) is None or key[0] is not attn or key[1] is not parts[0]:
                keys[i] = (attn, parts[0])
                s.attn, s.gu, s.down, s.n_gu, s.n_down = (
                    ctypes.pointer(attn),
                    ctypes.addressof(parts[0]),
                    ctypes.addressof(parts[1]),
                    len(parts[0]),
                    len(parts[1]),
                )
                s.norm, s.eps, s.act = norm._parameters["weight"].data_ptr(), norm.eps, act
            s.kbuf, s.vbuf, s.len = kbuf.data_ptr(), vbuf.data_ptr(), cache.length
            rows.append(cache)
        out = x.clone()
        done = lib.df_decode_layers(
            steps, n, cos.data_ptr(), sin.data_ptr(), out.data_ptr(), torch.get_num_threads()
        )
        for i, cache in enumerate(rows[:done]):
            cache.length += 1
            provider.dense_held(i)  # their use, counted as the per-layer path counts it
        # a part the planning took but the kernel did not: the per-layer path goes on from there
        if done < n:
            self.off = True
            log.warning("decode_chain_off", layer=done, reason="the kernel refused a part")
        return out, done
