"""The device expert cache under real memory pressure: it gives memory back before the headroom goes."""

from __future__ import annotations

import torch

from deltafind.device.device_cache import DeviceExpertCache, headroom_bytes, memory_info

MiB = 1 << 20


def test_cache_never_eats_into_the_headroom(accel: torch.device) -> None:
    if accel.type != "cuda":
        import pytest

        pytest.skip("fills device memory on purpose: CUDA only")
    cache = DeviceExpertCache(accel, None)  # unlimited by config: only the device limits it
    free, total = memory_info(accel)  # type: ignore[misc]
    room = headroom_bytes(total)
    hog = torch.empty(
        free - room - 256 * MiB, dtype=torch.uint8, device=accel
    )  # 256 MiB above the headroom stay free
    try:
        for i in range(12):
            t = torch.empty(64 * MiB, dtype=torch.uint8, device=accel)  # an "expert" just staged
            cache.put(i, t, t.numel())
            del t
            assert memory_info(accel)[0] >= room  # type: ignore[index]
        assert 1 <= len(cache) <= 4 and cache.evicted_for_headroom > 0
        assert 11 in cache  # the newest is kept, the oldest went
    finally:
        del hog
        cache.resize(0)
        torch.cuda.empty_cache()
