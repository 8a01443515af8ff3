"""Size the expert cache from the device's live free memory, keeping headroom.

On CUDA and MPS the expert cache lives in device memory. Its budget is the
configured `cache.expert_bytes`, capped at what is free once the model's own
allocations (spine, pinned tier) are made, less a headroom of at least 2 GiB or
20 % of the device, whichever is larger, for activations, KV and the allocator.
`DeviceExpertCache` re-checks free memory on every insert, so a growing KV cache
shrinks the expert cache instead of running the device out of memory.
"""

from __future__ import annotations

from typing import Any

import torch

from deltafind.log import get_logger
from deltafind.store.cache import ByteLRU

log = get_logger(__name__)
HEADROOM_MIN_BYTES = 2 << 30
HEADROOM_FRACTION = 0.20


def headroom_bytes(total_bytes: int) -> int:
    """Device memory never given to the expert cache: max(2 GiB, 20 % of the device)."""
    return max(HEADROOM_MIN_BYTES, int(total_bytes * HEADROOM_FRACTION))


def memory_info(device: torch.device) -> tuple[int, int] | None:
    """(free, total) bytes usable by this process on `device`, live; None on the CPU.

    CUDA: the driver's free memory plus what torch's caching allocator holds but
    does not use (it hands that out first). MPS (unified memory): the recommended
    working set (Metal's budget for this process) less what torch tensors hold now.
    """
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free + cached, total
    if device.type == "mps":
        total = int(torch.mps.recommended_max_memory())
        return max(0, total - int(torch.mps.current_allocated_memory())), total
    return None


def cache_budget(configured: int | None, free_bytes: int, total_bytes: int) -> int:
    """The expert cache budget: `configured` (None = as much as fits) capped at free less headroom."""
    fits = max(0, free_bytes - headroom_bytes(total_bytes))
    return fits if configured is None else min(configured, fits)


class DeviceExpertCache(ByteLRU[Any, Any]):
    """The expert LRU in device memory: a byte budget, and never below the headroom when inserting."""

    def __init__(self, device: torch.device, budget_bytes: int | None) -> None:
        self.device = device
        info = memory_info(device)
        super().__init__(budget_bytes if info is None else cache_budget(budget_bytes, *info))
        self.evicted_for_headroom = 0
        if info is not None:
            log.info(
                "device_expert_cache",
                device=str(device),
                configured_bytes=budget_bytes,
                budget_bytes=self.budget_bytes,
                free_bytes=info[0],
                total_bytes=info[1],
                headroom_bytes=headroom_bytes(info[1]),
            )

    def put(self, key: Any, value: Any, nbytes: int) -> None:
        if self.budget_bytes == 0:
            return  # streaming: nothing is kept, no need to ask the driver
        info = memory_info(self.device)
        if info is not None:
            # `value` is already allocated (free counts it as used): keeping it is what must leave headroom
            free, total = info
            short = headroom_bytes(total) - free
            if short > 0 and len(self):
                # Make room among our own entries (least recent first), then keep the budget as it was.
                budget = self.budget_bytes
                super().resize(max(0, self.used_bytes - short))
                super().resize(budget)
                self.evicted_for_headroom += 1
                free = memory_info(self.device)[0]  # type: ignore[index]
            if free < headroom_bytes(total):
                return  # the device is short even so: keep nothing new
        super().put(key, value, nbytes)

    def resize(self, budget_bytes: int | None) -> None:
        """A live reload: the new configured budget, capped by what the device has now."""
        info = memory_info(self.device)
        if info is not None:
            free, total = info
            budget_bytes = cache_budget(budget_bytes, free + self.used_bytes, total)
        super().resize(budget_bytes)


def spine_budget(device: torch.device, configured: int | None) -> int | None:
    """`[cache] spine_bytes` on a device: capped at its free memory less headroom, so the store's
    prefix-residency rule (store/spine.py) streams the layers that do not fit. CPU: unchanged."""
    info = memory_info(device)
    if info is None:
        return configured
    budget = cache_budget(configured, *info)
    if configured is None or budget < configured:
        log.info(
            "device_spine_budget",
            device=str(device),
            configured_bytes=configured,
            budget_bytes=budget,
            free_bytes=info[0],
            total_bytes=info[1],
            headroom_bytes=headroom_bytes(info[1]),
        )
    return budget
