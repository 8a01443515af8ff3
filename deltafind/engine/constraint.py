"""The contract between the engine and a decoding constraint (structured output, forced tool calls).

A `Constraint` belongs to one sequence. The engine asks it which tokens may come
next (`allowed`), masks every other token's logit to -inf before sampling or
verifying, and tells it each token the sequence emits (`advance`). A speculative
step advances through the draft tokens to get the mask of every row and rolls
back what the verifier rejects, so constrained output equals constrained decoding
without drafts. Grammar libraries (llguidance's matcher) implement it; the engine
never sees a grammar. `GenRequest.constraint` is a factory, so each of a request's
`n` sequences gets its own state; it is built on the request thread, off the
engine thread. A constraint that cannot go on (its grammar hit a resource limit
mid-output) raises `ConstraintError`: that sequence ends, reported as the client's 400.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from deltafind.errors import RequestError


class ConstraintError(RequestError):
    """The constraint cannot go on: its grammar ran into a limit of the grammar library mid-output."""


class Constraint(Protocol):
    def allowed(self) -> torch.Tensor | None:
        """bool [V]: the tokens allowed next (None: any token)."""

    def advance(self, token: int) -> bool:
        """Consume an emitted token; False if the constraint did not allow it (then nothing changed).

        Raises ConstraintError when the grammar cannot go on past an allowed token.
        """

    def rollback(self, n: int) -> None:
        """Forget the last `n` advanced tokens (a rejected draft)."""

    @property
    def done(self) -> bool:
        """The constrained text is complete: the sequence ends here (finish_reason "stop")."""


ConstraintFactory = Callable[[], Constraint]


def apply(logits: torch.Tensor, constraint: Constraint | None) -> torch.Tensor:
    """`logits` [V] with every token the constraint forbids at -inf (unchanged without one)."""
    if constraint is None:
        return logits
    mask = constraint.allowed()
    if mask is None:
        return logits
    mask = mask.to(logits.device)
    # a vocabulary padded past the tokenizer's: padding is never allowed
    if mask.shape[-1] < logits.shape[-1]:
        mask = torch.cat([mask, mask.new_zeros(logits.shape[-1] - mask.shape[-1])])
    return logits.masked_fill(~mask[: logits.shape[-1]], float("-inf"))
