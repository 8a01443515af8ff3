"""Device choice on a machine with an accelerator: auto takes it, the probe passes, fp32 stays fp32."""

from __future__ import annotations

import torch
from structlog.testing import capture_logs

from deltafind.device import select


def test_auto_picks_the_accelerator_and_logs_why(accel: torch.device) -> None:
    with capture_logs() as logs:
        dev = select.resolve_device("auto")
    assert dev.type == accel.type
    (line,) = [e for e in logs if e["event"] == "device_selected"]
    assert line["device"].startswith(accel.type)


def test_explicit_kind_probe_and_exact_fp32(accel: torch.device) -> None:
    kind = "cuda:0" if accel.type == "cuda" else "mps"
    dev = select.start_device(kind)
    assert dev.type == accel.type
    if dev.type == "cuda":
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32


def test_a_missing_gpu_index_names_the_visible_range(cuda: torch.device) -> None:
    import pytest

    with pytest.raises(select.DeviceError, match="CUDA device"):
        select.resolve_device(f"cuda:{torch.cuda.device_count()}")
