"""A step's prefill token budget from a time target, measured at run time: chunked prefill beside decode.

A long prompt prefilled in one step stalls every running stream for the whole prompt. Here each step
that prefills gets as many prompt tokens as fit `target_s` at the compute per row measured on earlier
prefill steps (their wall time less the time they waited on expert reads), so streams emit at least
every `target_s` plus their own rows. The floor is the drives': a chunk reads each expert it needs once
per layer, so it is never cut below the tokens whose compute covers the read wait measured per step
(reads then cost at most half a step). Seconds and token counts only: no tensors, no store.
"""

from __future__ import annotations

from dataclasses import dataclass

FIRST_CHUNK = 32  # tokens of the first prefill step, before anything is measured
SMOOTHING = 0.5  # weight of the newest step in the running estimates (they follow a context that grows)


@dataclass
class StepBudget:
    """Prefill tokens per step: `target_s` / measured seconds per row, but at least the drives' floor."""

    target_s: float | None = 0.5  # None or 0: no time target (chunks as large as memory and the cap allow)
    row_s: float | None = None  # compute seconds per row of a prefill step (running estimate)
    wait_s: float = 0.0  # seconds a prefill step waited on expert reads (running estimate)
    last_tokens: int = 0  # prefill tokens of the last step that prefilled

    def prefill_tokens(self, decode_rows: int) -> int | None:
        """Prompt tokens the next step may run beside `decode_rows` decode rows (None: no limit here)."""
        if not self.target_s:
            return None
        if self.row_s is None:
            return FIRST_CHUNK
        by_time = int(self.target_s / self.row_s) - decode_rows
        # the drives' floor: compute (tokens x row_s) at least as long as the step waits on reads; it may
        # at most double a step, so one cold read (a cache filling) does not turn into one huge step
        floor = min(int(self.wait_s / self.row_s), 2 * max(self.last_tokens, FIRST_CHUNK))
        return max(1, by_time, floor)

    def observe(self, prefill_tokens: int, rows: int, step_s: float, wait_s: float) -> None:
        """A step ran `prefill_tokens` prompt tokens in `rows` rows in all, in `step_s`, `wait_s` of it waiting on reads."""
        if prefill_tokens <= 0 or rows <= 0:
            return
        row_s = max(step_s - wait_s, 1e-9) / rows
        self.row_s = row_s if self.row_s is None else SMOOTHING * row_s + (1 - SMOOTHING) * self.row_s
        self.wait_s = SMOOTHING * wait_s + (1 - SMOOTHING) * self.wait_s
        self.last_tokens = prefill_tokens
