"""Single-sequence generation: prefill, then incremental decode against the cache.

Yields token ids as they are chosen; stops on EOS, stop token ids or the token
budget. Timing and expert counters go into a `GenerationStats`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from deltafind.engine.sampler import SamplingParams, make_sampler
from deltafind.models.ops.batch import Batch, SequenceCache


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    finish_reason: str = ""

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        # the first new token comes from prefill; decode steps produce the rest
        steps = max(self.new_tokens - 1, 0)
        return steps / self.decode_s if self.decode_s else 0.0


def forward_step(model: torch.nn.Module, cache: SequenceCache, ids: Sequence[int], all_logits: bool = False) -> torch.Tensor:
    """Run `ids` after what `cache` holds; returns logits ([n, V] or [1, V])."""
    device = model.model.embed_tokens.weight.device
    batch = Batch.of([(cache, len(ids))], device=device)
    return model(torch.tensor(list(ids), dtype=torch.long, device=device), batch, all_logits=all_logits)


def generate(
    model: torch.nn.Module,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    eos_token_ids: Sequence[int] = (),
    stats: GenerationStats | None = None,
    draft: Any = None,
    draft_policy: Any = None,
    draft_stats: Any = None,
) -> Iterator[int]:
    """Yield new token ids for `prompt_ids` under `params`.

    With `draft` (a `DraftSource`), decoding is speculative (engine/speculative.py):
    the same tokens under greedy, the same distribution under sampling;
    `draft_policy` is a `PolicyOptions`, `draft_stats` a `DraftStats` to fill.
    """
    if draft is not None:
        from deltafind.engine.speculative import generate_speculative  # it builds on this module

        yield from generate_speculative(model, prompt_ids, params, draft, draft_policy, eos_token_ids, stats, draft_stats)
        return
    stats = stats if stats is not None else GenerationStats()
    stats.prompt_tokens = len(prompt_ids)
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    sample = make_sampler(params)
    if params.max_new_tokens == 0:
        stats.finish_reason = "length"
        return
    cache = SequenceCache(model.num_layers)
    with torch.inference_mode():
        t0 = time.perf_counter()
        logits = forward_step(model, cache, prompt_ids)[-1]
        stats.prefill_s = time.perf_counter() - t0
        while True:
            token = sample(logits)
            stats.new_tokens += 1
            yield token
            if token in stop:
                stats.finish_reason = "stop"
                break
            if stats.new_tokens >= params.max_new_tokens:
                stats.finish_reason = "length"
                break
            t0 = time.perf_counter()
            logits = forward_step(model, cache, [token])[-1]
            stats.decode_s += time.perf_counter() - t0
