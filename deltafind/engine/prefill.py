"""How many prompt tokens one step runs: the prefill chunk, as large as the activation memory allows.

A step reads each expert its tokens chose once per layer (`models/ops/moe.dispatch` groups tokens
by expert), so a chunk of T tokens reads E(1-(1-k/E)^T) experts a layer: bytes per prompt token
fall as T grows, and the largest chunk that fits is the cheapest. Its working set grows with T:
a dozen hidden-width rows a token, one partial output per chosen expert, one expert's gate/up
rows. Attention adds nothing per context position: models/ops/attention.py never makes a score
matrix (blockwise softmax), so a chunk after a long context is as large as the first. `PrefillPlan`
holds those costs (from the model's config) and the budget (memory free at load, less what the
caches may still take, halved for allocator slack); `tokens(cached)` is the chunk for a sequence
with `cached` tokens computed.
Token counts and bytes only: no tensors, no store. `release_memory` hands what a long prefill's
activations left in the C heap back to the OS once the engine is idle.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from deltafind.models.contract import token_widths

RELEASE_AFTER_TOKENS = (
    2048  # prompt tokens run since the last release that make the next idle moment release
)
ROWS_PER_TOKEN = (
    12  # hidden-width rows alive at once per token: residual, norms, q/k/v/o, mixture, outputs
)
ATTN_ROWS_PER_TOKEN = (
    6  # all heads' rows alive at once per token in attention: q, k, v, output, the merge's two
)
SAFETY = 0.5  # of the memory free at load: allocator slack, transients the estimate leaves out


@dataclass(frozen=True)
class PrefillPlan:
    """A chunk T fits when T * (token_bytes + score_bytes * (cached + T)) <= budget_bytes."""

    budget_bytes: int
    token_bytes: int  # working set per token that does not depend on the context
    score_bytes: int  # attention scores (and mask) per token per context position
    cap: int | None = None  # [server] max_prefill_tokens

    def tokens(self, cached: int = 0) -> int:
        """The largest chunk (>= 1) that fits after `cached` tokens, within the cap."""
        a, b = self.score_bytes, self.token_bytes + self.score_bytes * cached
        if a:  # a*T^2 + b*T - budget <= 0
            t = int((-b + math.sqrt(b * b + 4 * a * self.budget_bytes)) / (2 * a))
        else:
            t = self.budget_bytes // max(b, 1)
        return max(1, min(t, self.cap or t))


def plan_for(
    args: Any, budget_bytes: int, cap: int | None = None, itemsize: int = 4
) -> PrefillPlan:
    """The prefill plan of a model whose config is `args` (any family's `ModelArgs`), in `itemsize`-byte activations."""
    hidden, k, routed, inter, heads = token_widths(args)
    # MLA's heads are wider than hidden / heads (K3: 96 x 192 against 7168)
    head = getattr(args, "qk_nope_head_dim", 0) + getattr(args, "qk_rope_head_dim", 0)
    head = head or getattr(args, "head_dim", None) or hidden // max(heads, 1)
    token = itemsize * (
        ROWS_PER_TOKEN * hidden + k * routed + 2 * inter + ATTN_ROWS_PER_TOKEN * heads * head
    )
    # No score term: the attention's working set is per token plus fixed key blocks. The quadratic
    # term it had (fp32 scores and a mask, from before the blockwise kernel) cut a 1M-context K3
    # chunk to ~42 tokens, each re-reading most of every layer's experts.
    return PrefillPlan(max(budget_bytes, 0), token, 0, cap)


def free_bytes(device: torch.device) -> int:
    """Memory free for new allocations now: a GPU's free memory, else the host's MemAvailable."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as f:
            return next(
                int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")
            )
    except (OSError, StopIteration):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def activation_budget(device: torch.device, reserved_bytes: int) -> int:
    """What a step may use for activations: free memory less `reserved_bytes` (caches still to fill), times SAFETY."""
    return int(SAFETY * max(free_bytes(device) - reserved_bytes, 0))


def rss_bytes() -> int:
    """This process's resident set size now (0 where /proc is absent)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


_LIBC = _libc()


def release_memory() -> dict[str, float]:
    """Return the C heap's free pages to the OS: glibc keeps freed memory in its arenas (one per
    thread that allocated), so after a long prefill's activations are freed the RSS stays at its
    peak until something calls malloc_trim. Costs a walk of the heap (milliseconds); glibc only."""
    if _LIBC is None or not hasattr(_LIBC, "malloc_trim"):
        return {}
    t0, before = time.perf_counter(), rss_bytes()
    _LIBC.malloc_trim(0)
    return {
        "rss_before": before,
        "rss_after": rss_bytes(),
        "seconds": round(time.perf_counter() - t0, 4),
    }
