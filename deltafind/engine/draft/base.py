"""The contract between draft sources and the verifier (engine/speculative.py).

A `DraftSource` is loaded once per model; `session(prompt_ids)` starts one
sequence's drafting state (its own caches, if any). Each step the verifier asks
the session for up to `width` tokens after `history` (every token of the
sequence so far; `history[-1]` is the pending token: emitted, not yet run by
the target), runs `[pending, *proposal.tokens]` through the target in one pass,
accepts a prefix, and calls `commit` with the new history. A source only ever
proposes: output is decided by the target alone.

Sources that need the target's hidden states (DSpark) name the target layers
in `capture_layers`; the target then fills `Batch.captured` and the verifier
passes the rows of the positions it committed to `commit`.

Additive, optional (the verifier checks with `hasattr`):
- `DraftSession.use_target_cache(cache)`: the verifier hands over the target's
  `SequenceCache` before the first `propose` (and again if it changes). A source
  may run extra positions through it (the layer-skip self-draft runs the target's
  first layers) but must truncate it back to its length on entry before returning.
- `DraftSource.check_target(net)`: raise DraftError when the source cannot draft
  for this target (wrong vocabulary, unsupported family); called once at wiring.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from deltafind.engine.sampler import SamplingParams, greedy_tokens, sampling_probs


@dataclass
class Proposal:
    """Proposed tokens; `q` [len(tokens), V] holds the fp32 distributions they were
    drawn from (under the request's sampling params), or None for a deterministic
    proposal (n-gram, cross-tokenizer, greedy drafts)."""

    tokens: list[int]
    q: torch.Tensor | None = None


def draw(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[int, torch.Tensor | None]:
    """A draft model's next token from `logits` [V]: argmax under greedy, else sampled; with the q it came from."""
    if params.temperature == 0.0:
        return greedy_tokens(logits)[0], None
    q = sampling_probs(logits, params)
    return int(torch.multinomial(q, 1, generator=generator)), q


class DraftSession(Protocol):
    def propose(
        self,
        history: Sequence[int],
        width: int,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> Proposal:
        """Up to `width` tokens to follow `history` (may be fewer, or none)."""
        ...

    def commit(self, history: Sequence[int], captured: torch.Tensor | None) -> None:
        """The target accepted up to `history[:-1]` (history[-1] is the new pending token).

        `captured` is [n, len(capture_layers) * hidden] rows, in `capture_layers`
        order, for the n positions the target committed since the last call
        (prefill included), or None when the source captures nothing."""
        ...

    def close(self) -> None: ...


class DraftSource(Protocol):
    name: str  # "self", "ngram", "dspark", "store:<path>", "cross:<path>"
    capture_layers: tuple[
        int, ...
    ]  # target layers whose output hidden rows the source needs; () = none

    def session(self, prompt_ids: Sequence[int]) -> DraftSession: ...

    def close(self) -> None: ...


class DraftError(RuntimeError):
    """A draft source failed; the verifier logs it and decodes target-only."""
