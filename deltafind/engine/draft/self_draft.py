"""Layer-skip self-draft: the target's first N layers, then its final norm and head.

No second model and no second cache: the draft runs its tokens through the
first N layers of the target's own cache and truncates it back before the
verify pass. That is exact because those layers' cache entries for a position
depend only on the tokens up to it, which the verify pass recomputes anyway
(it appends over the truncated rows). Works for the families whose forward runs a layer
prefix (`layer_prefix`, models/contract.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deltafind.engine.draft.base import DraftError, Proposal, draw
from deltafind.engine.sampler import SamplingParams
from deltafind.models.ops.batch import Batch, SequenceCache

# Chosen by measurement on the demo model (tests/bench/bench_speculative.py --sweep-layers 6,...,26):
# 22 of 30 layers accepted 23% and lost least; shallower drafts accept under 10%. See RESULTS.md.
DEFAULT_FRACTION = 0.75


def default_layers(num_layers: int) -> int:
    return max(1, min(num_layers - 1, round(num_layers * DEFAULT_FRACTION)))


class SelfDraftSession:
    def __init__(self, net: torch.nn.Module, num_layers: int) -> None:
        self.net, self.num_layers = net, num_layers
        self.cache: SequenceCache | None = None
        self.device = net.device

    def use_target_cache(self, cache: SequenceCache) -> None:
        self.cache = cache

    def propose(
        self,
        history: Sequence[int],
        width: int,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> Proposal:
        cache = self.cache
        if cache is None:
            raise DraftError("the self-draft was given no target cache")
        length = cache.length
        if length != len(history) - 1:
            raise DraftError(
                f"the target cache holds {length} positions, expected {len(history) - 1}"
            )
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        token = history[-1]
        try:
            with torch.inference_mode():
                for _ in range(width):
                    batch = Batch.of([(cache, 1)], device=self.device)
                    ids = torch.tensor([token], dtype=torch.long, device=self.device)
                    logits = self.net(ids, batch, num_layers=self.num_layers)[0]  # [V]
                    token, q = draw(logits, params, generator)
                    tokens.append(token)
                    if q is not None:
                        qs.append(q)
        finally:
            cache.truncate(
                length
            )  # the first N layers' rows past `length` are the draft's: drop them
        return Proposal(tokens, torch.stack(qs) if qs else None)

    def commit(self, history: Sequence[int], captured: torch.Tensor | None) -> None:
        pass  # the target's cache already holds the committed rows

    def close(self) -> None:
        self.cache = None


class SelfDraftSource:
    """Drafts with the target's first `num_layers` layers (default: three quarters of them)."""

    name = "self"
    capture_layers: tuple[int, ...] = ()

    def __init__(self, net: torch.nn.Module, num_layers: int | None = None) -> None:
        self.check_target(net)
        total = net.num_layers
        self.num_layers = default_layers(total) if num_layers is None else num_layers
        if not 1 <= self.num_layers < total:
            raise DraftError(
                f"self-draft layers must be in 1..{total - 1} for this {total}-layer model (got {self.num_layers})"
            )
        self.net = net

    @staticmethod
    def check_target(net: torch.nn.Module) -> None:
        if not net.layer_prefix:
            raise DraftError(
                f"the self-draft needs a model whose forward runs a layer prefix; "
                f"{type(net).__module__} has none (use --draft ngram, or dspark for Kimi K3)"
            )

    def session(self, prompt_ids: Sequence[int]) -> SelfDraftSession:
        return SelfDraftSession(self.net, self.num_layers)

    def close(self) -> None:
        pass
