"""Token sampling: greedy, temperature, top-k, top-p, seeded.

`make_sampler` returns a callable from last-token logits [V] to a token id;
the same seed gives the same tokens.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from deltafind.errors import RequestError


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if self.max_new_tokens < 0:
            raise RequestError(
                f"max_new_tokens must be >= 0 (got {self.max_new_tokens})", "max_tokens"
            )
        if not 0.0 <= self.temperature <= 100.0:
            raise RequestError(
                f"temperature must be in [0, 100] (got {self.temperature})", "temperature"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p must be in (0, 1] (got {self.top_p})", "top_p")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0 (got {self.top_k})", "top_k")


def make_generator(params: SamplingParams) -> torch.Generator | None:
    """The seeded generator a sampling request draws from (None under greedy)."""
    if params.temperature == 0.0:
        return None
    return torch.Generator().manual_seed(
        params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
    )


def greedy_tokens(logits: torch.Tensor) -> list[int]:
    """The index of the largest logit of each row of logits [..., V]: the first one on ties, and a NaN
    counts as largest (torch.argmax's rule and numpy's). On the CPU through numpy: torch.argmax took
    96 us over the demo's 49k vocabulary, a greedy token's biggest single op, numpy's 4.5 us."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and not logits.requires_grad:
        return logits.numpy().argmax(axis=-1).reshape(-1).tolist()
    return torch.argmax(logits, dim=-1).reshape(-1).tolist()


def make_sampler(
    params: SamplingParams, generator: torch.Generator | None = None
) -> Callable[[torch.Tensor], int]:
    """A callable from logits [V] to a token id; draws from `generator` (default: a new seeded one)."""
    if params.temperature == 0.0:
        return lambda logits: greedy_tokens(logits)[0]
    gen = generator if generator is not None else make_generator(params)

    def sample(logits: torch.Tensor) -> int:
        probs = sampling_probs(logits, params)
        return int(torch.multinomial(probs, 1, generator=gen))

    return sample


def sampling_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a temperature/top-k/top-p sampler draws from (also used by verification).

    Computed in float64 for every value the schema accepts: a subnormal temperature (1e-320)
    or top_p (1e-300) rounds to 0 in float32, which once gave NaN or dropped every token.
    The best logit is shifted to 0 before dividing, so a tiny temperature sends the rest to
    -inf (near-greedy) instead of overflowing to inf - inf. The top token always survives top-p.
    """
    logits = logits.detach().to("cpu", torch.float64)
    best = logits.max()
    if not bool(torch.isfinite(best)):
        raise RequestError(
            f"no token can be sampled: the best logit is {float(best)} (every token forbidden?)",
            "logits",
        )
    logits = (logits - best) / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        # ordered by logit, ties by index as argmax breaks them: the best token comes first even where
        # its probability rounds equal to another's (logits 0 and 3e-40 give 0.5 and 0.5)
        order = torch.sort(logits, descending=True, stable=True).indices
        sorted_probs = probs[order]
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        drop = (torch.cumsum(sorted_probs, 0) - sorted_probs) >= params.top_p
        drop[0] = False
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return (probs / probs.sum()).float()
