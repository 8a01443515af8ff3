"""Device failures: at start the model opens on the CPU (logged); mid-request only that request fails."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from structlog.testing import capture_logs

from deltafind.api import Model
from deltafind.engine.sampler import SamplingParams
from deltafind.engine.scheduler import Scheduler, collect
from deltafind.engine.sequence import GenRequest


@contextlib.contextmanager
def starved(device: torch.device) -> Iterator[None]:
    """No more GPU memory for this process: new segments are refused (memory fraction) and the
    allocator's cached free blocks are taken, so the next allocation raises a real OOM."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(
        min(1.0, (torch.cuda.memory_reserved(device) + 1024) / total), device
    )
    hog = []
    try:
        # large-pool sizes first (> 1 MiB), then the small pool down to its 512-byte rounding
        for size in (1 << 30, 1 << 26, 1 << 22, (1 << 20) + 512, 1 << 20, 1 << 16, 1 << 12, 512):
            while True:
                try:
                    hog.append(torch.empty(size, dtype=torch.uint8, device=device))
                except torch.OutOfMemoryError:
                    break
        yield
    finally:
        hog.clear()
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.empty_cache()


def test_a_device_that_fails_at_start_falls_back_to_cpu(cuda: torch.device, k3_store: Path) -> None:
    ref = Model.open(k3_store, device="cpu", expert_bytes=0)
    want = ref.generate(ref.tokenizer.encode("fallback"), max_new_tokens=6)
    ref.close()
    with starved(cuda), capture_logs() as logs:
        model = Model.open(k3_store, device="cuda", expert_bytes=0)
    try:
        assert any(
            e["event"] in ("device_unavailable", "device_failed_at_start")
            and e["fallback"] == "cpu"
            for e in logs
        )
        assert model.net.model.embed_tokens.weight.device.type == "cpu"
        assert model.generate(model.tokenizer.encode("fallback"), max_new_tokens=6) == want
    finally:
        model.close()


def test_an_oom_mid_request_fails_that_request_only(cuda: torch.device, k3_store: Path) -> None:
    model = Model.open(k3_store, device="cuda", expert_bytes=0)
    sched = Scheduler(model.net, model.eos_token_ids)
    ids = tuple(model.tokenizer.encode("mid-request failure"))
    params = SamplingParams(max_new_tokens=6)
    try:
        want, fin = collect(sched.submit(GenRequest(ids, params)), timeout=120)
        assert fin.reason == "length"
        with starved(cuda):
            _, failed = collect(sched.submit(GenRequest(ids, params)), timeout=120)
        assert failed.reason == "error" and "OutOfMemory" in (failed.error or "")
        again, fin = collect(sched.submit(GenRequest(ids, params)), timeout=120)
        assert fin.reason == "length" and again == want
    finally:
        sched.close()
        model.close()
