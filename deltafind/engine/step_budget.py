"""A step's prefill token budget from a time target, measured at run time: chunked prefill beside decode.

A long prompt prefilled in one step stalls every running stream for the whole prompt. A step's wall
time is modelled as `fixed_s + token_s * T` for T prompt tokens: `fixed_s` is what a step costs with no
prefill (measured on decode steps: every layer's pass and its expert reads), `token_s` what each prompt
token adds (measured on prefill steps, less `fixed_s`). A step gets the T that fits `target_s`, but never
fewer than `fixed_s / token_s`: a chunk's tokens take at least as long as the part every step pays, so a
chunked prompt costs at most about twice one big step's compute and reads per token, and the streams'
gap is at most about max(target_s, 2 * fixed_s). A chunk is never under MIN_CHUNK tokens either: below
that the matmuls run far under the kernels' multi-row rate (tests/bench/bench_kernels_peak.py) and a
4,000-token demo prompt cost 3.2x one step in 7-token chunks. With no stream decoding beside it (nobody
waits on this step) a prompt's chunks aim at ALONE_FACTOR x target_s: a cancel or a new request still
lands within a few seconds, and the per-step costs are paid rarely. Seconds and token counts only: no
tensors, no store.
"""

from __future__ import annotations

from dataclasses import dataclass

FIRST_CHUNK = 64  # tokens of the first prefill step, before anything is measured
MIN_CHUNK = 64  # fewest prompt tokens a prefilling step runs (the kernels' rate falls off below)
ALONE_FACTOR = 4  # with no stream decoding beside the prompt, its steps aim at this many targets
SMOOTHING = (
    0.5  # weight of the newest step in the running estimates (they follow a context that grows)
)


@dataclass
class StepBudget:
    """Prefill tokens per step: (target_s - fixed_s) / token_s, at least fixed_s / token_s."""

    target_s: float | None = (
        0.5  # None or 0: no time target (chunks as large as memory and the cap allow)
    )
    fixed_s: float | None = None  # seconds of a step without prefill (running estimate)
    token_s: float | None = None  # seconds each prompt token adds to a step (running estimate)
    last_tokens: int = 0  # prefill tokens of the last step that prefilled

    def prefill_tokens(self, alone: bool = False) -> int | None:
        """Prompt tokens the next step may run (None: no limit here); `alone`: no stream decodes beside it."""
        if not self.target_s:
            return None
        if self.token_s is None:
            return FIRST_CHUNK
        fixed = self.fixed_s or 0.0
        target = self.target_s * (ALONE_FACTOR if alone else 1)
        tokens = max(target - fixed, fixed) / self.token_s
        # at most double from one step to the next: one noisy estimate never makes one huge step
        return max(MIN_CHUNK, int(min(tokens, 2 * max(self.last_tokens, FIRST_CHUNK))))

    def observe(self, prefill_tokens: int, step_s: float) -> None:
        """A step that ran `prefill_tokens` prompt tokens (0: decode rows only) took `step_s`."""
        if prefill_tokens <= 0:
            self.fixed_s = step_s if self.fixed_s is None else _smooth(self.fixed_s, step_s)
            return
        token_s = max(step_s - (self.fixed_s or 0.0), 1e-3 * step_s) / prefill_tokens
        self.token_s = token_s if self.token_s is None else _smooth(self.token_s, token_s)
        self.last_tokens = prefill_tokens


def _smooth(old: float, new: float) -> float:
    return SMOOTHING * new + (1 - SMOOTHING) * old
