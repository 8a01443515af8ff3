"""Resolve `[device] kind` ("auto" | "cpu" | "cuda" | "cuda:N" | "mps") to a torch.device.

`auto` takes CUDA, then MPS, then the CPU, and logs why each earlier choice was
passed over. An explicit kind that this machine cannot honour raises
`DeviceError` naming the cause and the fix; `probe` runs a tiny op there so a
broken driver shows up at start, not in the first request.
"""

from __future__ import annotations

import contextlib

import torch

from deltafind.config.section import DEVICE_RE
from deltafind.errors import ConfigError, DeltafindError
from deltafind.log import get_logger

log = get_logger(__name__)


class DeviceError(DeltafindError):
    """The requested compute device is absent or failed."""

    exit_code = 4


def cuda_unavailable_reason() -> str | None:
    """Why CUDA cannot be used here, or None when it can."""
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) was built without CUDA"
    if not torch.cuda.is_available():
        return "torch has CUDA but sees no CUDA device (no GPU, no driver, or CUDA_VISIBLE_DEVICES hides it)"
    return None


def mps_unavailable_reason() -> str | None:
    """Why MPS (Apple GPU) cannot be used here, or None when it can."""
    mps = getattr(torch.backends, "mps", None)
    if mps is None or not mps.is_built():
        return f"this torch ({torch.__version__}) was built without MPS"
    if not mps.is_available():
        return "torch has MPS but no Apple GPU is usable (macOS < 12.3 or not Apple silicon)"
    return None


def resolve_device(kind: str) -> torch.device:
    """The torch.device for a `[device] kind` value; DeviceError when it is unavailable, ConfigError when malformed."""
    kind = kind.strip().lower()
    if not DEVICE_RE.fullmatch(kind):
        raise ConfigError(
            f"[device] kind = {kind!r}: expected auto, cpu, cuda, cuda:N (N = GPU index) or mps"
        )
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "auto":
        no_cuda = cuda_unavailable_reason()
        if no_cuda is None:
            dev = torch.device("cuda", torch.cuda.current_device())
            log.info(
                "device_selected",
                kind="auto",
                device=str(dev),
                name=torch.cuda.get_device_name(dev),
                reason="cuda available",
            )
            return dev
        no_mps = mps_unavailable_reason()
        if no_mps is None:
            log.info("device_selected", kind="auto", device="mps", reason="no cuda: " + no_cuda)
            return torch.device("mps")
        log.info(
            "device_selected",
            kind="auto",
            device="cpu",
            reason=f"no cuda: {no_cuda}; no mps: {no_mps}",
        )
        return torch.device("cpu")
    if kind.startswith("cuda"):
        why = cuda_unavailable_reason()
        if why is not None:
            raise DeviceError(
                f"[device] kind = {kind!r}, but {why}; install a CUDA build of torch or set kind = \"cpu\" (or \"auto\")"
            )
        index = int(kind.partition(":")[2] or torch.cuda.current_device())
        count = torch.cuda.device_count()
        if index >= count:
            raise DeviceError(
                f"[device] kind = {kind!r}, but only {count} CUDA device(s) are visible (cuda:0..cuda:{count - 1})"
            )
        return torch.device("cuda", index)
    why = mps_unavailable_reason()
    if why is not None:
        raise DeviceError(f"[device] kind = \"mps\", but {why}; set kind = \"cpu\" (or \"auto\")")
    return torch.device("mps")


def probe(device: torch.device) -> None:
    """Allocate, compute and read back on `device`; raise DeviceError if any step fails."""
    try:
        a = torch.arange(64, dtype=torch.float32, device=device).view(8, 8)
        got = float((a @ a).sum().cpu())
    except (RuntimeError, AssertionError) as e:  # torch.AcceleratorError and OOM are RuntimeErrors
        raise DeviceError(
            f"{device}: a test computation failed ({type(e).__name__}: {e}); check the driver or set [device] kind = \"cpu\""
        ) from e
    want = float(
        (
            torch.arange(64, dtype=torch.float64).view(8, 8)
            @ torch.arange(64, dtype=torch.float64).view(8, 8)
        ).sum()
    )
    if got != want:
        raise DeviceError(
            f"{device}: a test computation returned {got}, expected {want}; the device is unreliable"
        )


def exact_fp32(device: torch.device) -> None:
    """Keep fp32 matmuls and convolutions in true fp32 on CUDA (no TF32), as the CPU reference path computes.

    torch lets cuDNN convolutions use TF32 by default (KDA's short conv is one);
    at fp32 deltafind promises results within fp32 rounding of the CPU path.
    """
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def synchronize(device: torch.device) -> None:
    """Wait for all queued work on `device` (a no-op on the CPU); for timing and tests."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


# What a device that fails while the model is being placed on it raises (OOM and driver errors are RuntimeErrors).
START_ERRORS = (DeviceError, RuntimeError)


# torch's MKL VML functions pick their kernel on their first call, and first calls made at once by
# intra-op threads can run the low-accuracy kernel on one thread's chunk (pytorch/pytorch#188792).
# Measured here (torch 2.13, 2 threads): a fresh process's first cos of a 64 x 64 tensor was off by
# 1.5e-4 on half its elements in 5 of 40 starts, and its first sin and exp as often; never after
# one call of any of them on a 16-element tensor (one thread). The rope tables of a first prompt
# take that path. A race that no test triggers on demand (nor does upstream's fix, pytorch#188791).
VML_FUNCTIONS = ("cos", "sin", "exp", "log", "sqrt", "rsqrt", "tanh", "erf", "expm1", "log1p")


def settle_cpu_math() -> None:
    """Call each VML function once on this thread, in each float precision, before any concurrent use."""
    for dtype in (torch.float32, torch.float64):
        x = torch.full((16,), 0.5, dtype=dtype)
        for name in VML_FUNCTIONS:
            getattr(torch, name)(x)


def start_device(kind: str | torch.device) -> torch.device:
    """Resolve, probe and configure the compute device; an unusable one logs why and gives the CPU.

    Starting on the CPU instead of failing keeps a service up on a machine whose
    GPU or driver is gone; the log line says so, with the fix. The CPU's own math is
    settled first (`settle_cpu_math`): every device runs some ops there.
    """
    settle_cpu_math()
    try:
        dev = kind if isinstance(kind, torch.device) else resolve_device(str(kind))
        if dev.type != "cpu":
            probe(dev)
            exact_fp32(dev)
    except DeviceError as e:
        log.error("device_unavailable", requested=str(kind), error=str(e), fallback="cpu")
        return torch.device("cpu")
    return dev


def release(device: torch.device) -> None:
    """Hand a failed start's device memory back (best effort) before retrying on the CPU."""
    import gc

    gc.collect()
    with contextlib.suppress(RuntimeError):
        if device.type == "cuda":
            torch.cuda.empty_cache()
        elif device.type == "mps":
            torch.mps.empty_cache()
