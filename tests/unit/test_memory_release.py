"""Memory that returns: what a long prefill freed goes back to the OS once the engine is idle.

glibc keeps freed heap memory in the arena of the thread that allocated it (the engine
thread), so without a trim the worker's RSS stays at its peak after long prompts are done.
Checked against the real allocator (Linux/glibc only), then that the engine trims once idle
after long prompts, not after short ones, and that a prompt-cache entry keeps no more memory
alive than it counts against `[cache] prompt_bytes`.
"""

from __future__ import annotations

import sys
import threading

import pytest
import torch
from structlog.testing import capture_logs

from deltafind import Model
from deltafind.engine.core import EngineCore
from deltafind.engine.prefill import RELEASE_AFTER_TOKENS, release_memory, rss_bytes
from deltafind.engine.prefix_cache import PrefixCache
from deltafind.engine.step import SchedulerLimits
from deltafind.models.ops.batch import SequenceCache
from deltafind.models.ops.kda_layer import KDAState
from tests.unit.test_prefix_checkpoint import _request, _run
from tests.unit.test_prefix_checkpoint import model as model  # the K3 and qwen3_moe stores

MiB = 1 << 20
pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="glibc's malloc_trim, /proc RSS"
)


def test_freed_heap_memory_goes_back_to_the_os() -> None:
    # what a prefill chunk leaves: many mid-size blocks, freed, one kept
    def activations() -> torch.Tensor:
        big = torch.empty(4 * MiB, dtype=torch.uint8)
        del big  # freed first: glibc's mmap threshold rises past the rows' size, so they come from the heap
        rows = [torch.ones(900 * 1024, dtype=torch.uint8) for _ in range(400)]
        kept = torch.ones(1000, dtype=torch.uint8)  # above them in the heap: the top cannot shrink
        del rows
        return kept

    before, box = rss_bytes(), []
    t = threading.Thread(target=lambda: box.append(activations()))
    t.start()
    t.join()
    held = rss_bytes()
    assert held - before > 200 * MiB  # the allocator kept what was freed
    got = release_memory()
    assert got["rss_before"] >= held - 16 * MiB and got["rss_after"] - before < 64 * MiB


def test_the_engine_releases_once_idle_after_long_prompts(model: Model) -> None:
    core = EngineCore(
        model.net,
        model.eos_token_ids,
        SchedulerLimits(max_step_tokens=1 << 20, max_context=1 << 14),
    )
    with capture_logs() as logs:
        _run(core, _request([(i * 7) % 230 + 3 for i in range(RELEASE_AFTER_TOKENS)], 0))
        _run(core, _request([5, 6, 7], 0))  # short: no trim
    released = [e for e in logs if e["event"] == "memory_released"]
    assert len(released) == 1 and released[0]["rss_after"] <= released[0]["rss_before"]


def test_a_prompt_cache_entry_holds_no_more_than_it_counts() -> None:
    # A sequence whose last pass verified drafts in a step beside another prompt's long prefill chunk:
    # its KDA state keeps that pass's rows (for `truncate`) as slices of the step's whole gate tensor.
    step_gates = torch.ones(
        64 * MiB, dtype=torch.float32
    )  # 256 MiB, touched; mmap'd, so freed at once
    state = KDAState()
    state.conv, state.recurrent, state.length = (
        [torch.zeros(3, 32) for _ in range(3)],
        torch.zeros(2, 16, 16),
        4,
    )
    state.kept_rows, state.kept_start, state.kept_inputs = 3, state.recurrent, [step_gates[:3]]
    cache = SequenceCache(0)
    cache.layers, cache.length = [state], 4
    before = rss_bytes()
    entry = PrefixCache(1 << 30).put([1, 2, 3, 4], cache)
    assert entry is not None
    del step_gates, state, cache
    release_memory()
    held = rss_bytes() - (
        before - 256 * MiB
    )  # what stays alive beyond what the process held before the step
    assert held <= entry.nbytes + 16 * MiB, (held >> 20, entry.nbytes >> 20)
