"""Prompt-lookup drafting: continue the sequence as it continued after its last earlier match.

The longest suffix of the history (6 tokens down to 2) that occurred before is
looked up, most recent occurrence first, and the tokens that followed it are
proposed. Costs microseconds and no memory beyond an index of the history; pays
where output repeats the context (code edits, quoting, structured text).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deltafind.engine.draft.base import Proposal
from deltafind.engine.sampler import SamplingParams

MIN_N, MAX_N = 2, 6


class NgramSession:
    """One sequence's n-gram index: for each n-gram, where its most recent occurrence ends."""

    def __init__(self, min_n: int = MIN_N, max_n: int = MAX_N) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._last: dict[tuple[int, ...], int] = {}  # n-gram -> index of its last token
        self._indexed = 0  # n-grams ending before this index are in `_last`
        self._history: list[int] = []

    def _index(self, history: Sequence[int], upto: int) -> None:
        # history only grows by appending (the verifier never rewinds committed tokens)
        if (
            len(history) < len(self._history)
            or list(history[: len(self._history)]) != self._history
        ):
            self._last, self._indexed = {}, 0  # a different sequence: start again
        self._history = list(history)
        for end in range(self._indexed, upto):
            for n in range(self.min_n, min(self.max_n, end + 1) + 1):
                self._last[tuple(history[end - n + 1 : end + 1])] = end
        self._indexed = max(self._indexed, upto)

    def propose(
        self,
        history: Sequence[int],
        width: int,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> Proposal:
        h = len(history)
        # index n-grams ending before the last token: their continuation is known and the
        # suffix itself (ending at h - 1) must not match itself
        self._index(history, h - 1)
        for n in range(min(self.max_n, h - 1), self.min_n - 1, -1):
            end = self._last.get(tuple(history[h - n :]))
            if end is not None:
                return Proposal(list(history[end + 1 : min(end + 1 + width, h)]))
        return Proposal([])

    def commit(self, history: Sequence[int], captured: torch.Tensor | None) -> None:
        pass  # propose indexes lazily

    def close(self) -> None:
        self._last = {}


class NgramSource:
    """The n-gram draft source (any model: it never runs one)."""

    name = "ngram"
    capture_layers: tuple[int, ...] = ()

    def __init__(self, min_n: int = MIN_N, max_n: int = MAX_N) -> None:
        self.min_n, self.max_n = min_n, max_n

    def session(self, prompt_ids: Sequence[int]) -> NgramSession:
        return NgramSession(self.min_n, self.max_n)

    def close(self) -> None:
        pass
