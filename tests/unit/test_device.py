"""The device layer on a CPU-only machine: choosing the device, falling back, the torch MXFP4
path, the staging contract, pinned-pool buffers and the device cache budget rule.

The GPU half of these checks (the same paths on CUDA/MPS against the CPU) is tests/gpu/.
References: the CPU C++ kernel and the plain spec decode for MXFP4; the unchanged CPU
path of the same store for tokens; the documented rule (max(2 GiB, 20 %) headroom, the README's device table) for budgets.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from deltafind.api import Model
from deltafind.device import device_cache, select, staging
from deltafind.errors import ConfigError
from deltafind.importer.setup import setup_store
from deltafind.importer.synthetic import open_synthetic
from deltafind.models import kimi_k3
from deltafind.models.ops import mxfp4
from deltafind.models.ops.cpu_kernels import load_kernel

GiB = 1 << 30
no_accelerator = pytest.mark.skipif(
    select.cuda_unavailable_reason() is None or select.mps_unavailable_reason() is None,
    reason="an accelerator is present: tests/gpu covers it",
)


@pytest.fixture(scope="module")
def k3_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("k3dev")
    setup_store(
        open_synthetic("kimi_k3", "tiny", seed=3),
        root / "s",
        [root / "d0", root / "d1"],
        dense_slices=2,
        progress=False,
        names=kimi_k3.WEIGHTS,
    )
    return root / "s"


@pytest.fixture(scope="module")
def moe_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("moedev")
    setup_store(
        open_synthetic("qwen3_moe", "tiny", seed=1), root / "s", [root / "d0"], progress=False
    )
    return root / "s"


def _greedy(model: Model, n: int = 12) -> list[int]:
    return model.generate(model.tokenizer.encode("The device layer"), max_new_tokens=n)


# -- choosing the device -------------------------------------------------------


@no_accelerator
def test_auto_picks_cpu_here_and_logs_why() -> None:
    with capture_logs() as logs:
        assert select.resolve_device("auto") == torch.device("cpu")
    (line,) = [entry for entry in logs if entry["event"] == "device_selected"]
    assert line["device"] == "cpu" and "no cuda" in line["reason"] and "no mps" in line["reason"]


@no_accelerator
@pytest.mark.parametrize("kind", ["cuda", "cuda:1", "mps"])
def test_an_unavailable_device_names_the_fix(kind: str) -> None:
    with pytest.raises(select.DeviceError, match='kind = "cpu"'):
        select.resolve_device(kind)


@pytest.mark.parametrize("kind", ["gpu", "cuda:x", "tpu"])
def test_a_malformed_kind_is_a_config_error(kind: str) -> None:
    with pytest.raises(ConfigError, match="expected auto, cpu, cuda, cuda:N"):
        select.resolve_device(kind)


def test_cpu_probe_passes() -> None:
    select.probe(torch.device("cpu"))


@no_accelerator
def test_open_on_an_unavailable_device_falls_back_to_cpu_with_a_log_line(k3_store: Path) -> None:
    want = _greedy(m := Model.open(k3_store, device="cpu", expert_bytes=0))
    m.close()
    with capture_logs() as logs:
        model = Model.open(k3_store, device="cuda", expert_bytes=0)
    try:
        (line,) = [entry for entry in logs if entry["event"] == "device_unavailable"]
        assert (
            line["fallback"] == "cpu"
            and line["log_level"] == "error"
            and "without CUDA" in line["error"]
        )
        assert model.net.model.embed_tokens.weight.device.type == "cpu"
        assert _greedy(model) == want
    finally:
        model.close()


# -- the torch (device) MXFP4 path --------------------------------------------


def _random_pack(
    rows: int, cols: int, seed: int, lo: int = 118, hi: int = 127
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g),
        torch.randint(lo, hi, (rows, cols // 32), dtype=torch.uint8, generator=g),
    )


@pytest.mark.skipif(load_kernel() is None, reason="no C++ compiler: the kernel is not built")
@pytest.mark.parametrize(
    ("lo", "hi"), [(118, 127), (1, 255)]
)  # realistic scales; every legal E8M0 byte (subnormals too)
def test_torch_dequant_equals_the_cpp_kernel_bit_for_bit(lo: int, hi: int) -> None:
    packed, scale = _random_pack(130, 256, seed=lo, lo=lo, hi=hi)
    want = mxfp4.dequantize(packed, scale)  # the C++ kernel
    got = mxfp4.dequantize_torch(packed, scale)
    assert torch.equal(
        got.view(torch.int32), want.view(torch.int32)
    )  # bits, so -0.0 and subnormals count
    assert torch.equal(got, mxfp4.dequantize_reference(packed, scale))


def test_torch_linear_is_dequant_then_matmul_and_scratch_reuse_is_safe() -> None:
    a, b = _random_pack(64, 128, seed=1), _random_pack(96, 128, seed=2)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(3))
    with mxfp4.torch_path():
        ya = mxfp4.mxfp4_linear(x, *a)
        yb = mxfp4.mxfp4_linear(x, *b)  # reuses (and overwrites) the scratch matrix
    assert torch.equal(ya, torch.nn.functional.linear(x, mxfp4.dequantize_reference(*a)))
    assert torch.equal(yb, torch.nn.functional.linear(x, mxfp4.dequantize_reference(*b)))


@pytest.mark.skipif(load_kernel() is None, reason="no C++ compiler: the kernel is not built")
def test_torch_path_matches_the_fused_kernel_within_fp32_bound() -> None:
    packed, scale = _random_pack(200, 384, seed=5)
    x = torch.randn(5, 384, generator=torch.Generator().manual_seed(6))
    fused = mxfp4.mxfp4_linear(x, packed, scale)
    with mxfp4.torch_path():
        torch_y = mxfp4.mxfp4_linear(x, packed, scale)
    w = mxfp4.dequantize_reference(packed, scale).double()
    n, u = w.shape[1], 2.0**-24
    bound = (
        2 * (n * u / (1 - n * u)) * (x.double().abs() @ w.abs().T)
    )  # each side within gamma_n of exact
    assert ((fused.double() - torch_y.double()).abs() <= bound).all()


def test_k3_greedy_tokens_equal_on_the_torch_mxfp4_path(k3_store: Path) -> None:
    model = Model.open(k3_store, device="cpu", expert_bytes=0)
    try:
        ids = model.tokenizer.encode("The device layer")
        want, want_logits = _greedy(model), model.forward_logits(ids)
        with mxfp4.torch_path():
            got, got_logits = _greedy(model), model.forward_logits(ids)
    finally:
        model.close()
    assert got == want
    # Stated tolerance: fp32 summation order only, 1e-4 of the largest logit.
    assert (got_logits - want_logits).abs().max() <= 1e-4 * max(1.0, float(want_logits.abs().max()))


# -- staging -------------------------------------------------------------------


def test_make_stager_is_the_host_stager_on_cpu() -> None:
    assert isinstance(staging.make_stager(torch.device("cpu")), staging.HostStager)


@pytest.mark.parametrize("store", ["k3_store", "moe_store"])  # uint8 MXFP4 packs; float experts
def test_copying_stager_releases_after_copying_and_tokens_are_identical(
    store: str, request: pytest.FixtureRequest
) -> None:
    """The MPS-style stager (blocking copy, buffer released at once) run on the CPU: with a zero
    cache every read buffer is recycled at once, so tensors still over it would be overwritten."""
    path = request.getfixturevalue(store)
    ref = Model.open(path, device="cpu", expert_bytes=0)
    want = _greedy(ref)
    ref.close()
    model = Model.open(path, device="cpu", expert_bytes=0)
    model.experts.stager = staging.SyncStager(torch.device("cpu"))
    try:
        assert _greedy(model) == want
        st = model.experts.stager.stats
        assert (
            st.copies == model.experts.stats.read > 0 and st.bytes > 0
        )  # every record went through it
    finally:
        model.close()


def test_aligned_pool_buffers_work_as_read_buffers(k3_store: Path) -> None:
    """The CUDA read-buffer pool (here unpinned: no CUDA) serves preadv, sha256 and frombuffer in place."""
    pool = staging.PinnedBufferPool(max_free_bytes=1 << 20, pin=False)
    buf = pool.get(5000)
    assert len(buf) == 8192 and buf.ctypes.data % 4096 == 0
    pool.put(buf)
    assert pool.get(8000) is buf  # reused by size class
    ref = Model.open(k3_store, device="cpu", expert_bytes=0)
    want = _greedy(ref)
    ref.close()
    model = Model.open(k3_store, device="cpu", expert_bytes=0)
    model.experts.reader.buffers = staging.PinnedBufferPool(1 << 24, pin=False)
    try:
        assert _greedy(model) == want
        assert model.experts.reader.buffers.allocated_bytes > 0
    finally:
        model.close()


# -- the device cache budget --------------------------------------------------


@pytest.mark.parametrize(
    ("configured", "free", "total", "want"),
    [
        (None, 50 * GiB, 80 * GiB, 34 * GiB),  # headroom 20 % of 80 = 16 GiB
        (4 * GiB, 50 * GiB, 80 * GiB, 4 * GiB),  # the configured budget when it fits
        (None, 5 * GiB, 8 * GiB, 3 * GiB),  # 20 % of 8 GiB is below the 2 GiB floor
        (8 * GiB, 1 * GiB, 8 * GiB, 0),  # less free than the headroom: nothing
    ],
)
def test_cache_budget_keeps_max_2gib_or_20_percent_headroom(
    configured: int | None, free: int, total: int, want: int
) -> None:
    assert device_cache.cache_budget(configured, free, total) == want
    assert device_cache.headroom_bytes(total) == max(2 * GiB, math.floor(total * 0.2))


def test_device_cache_on_cpu_is_the_configured_lru() -> None:
    cache = device_cache.DeviceExpertCache(torch.device("cpu"), 100)
    assert device_cache.memory_info(torch.device("cpu")) is None
    cache.put("a", object(), 60)
    cache.put("b", object(), 60)  # over budget: the least recent goes
    assert "a" not in cache and "b" in cache and cache.used_bytes == 60
    assert device_cache.spine_budget(torch.device("cpu"), 123) == 123


# -- the prepared GPU check -------------------------------------------------------


@pytest.mark.skipif(
    select.cuda_unavailable_reason() is None, reason="CUDA is present: check.sh would run for real"
)
def test_gpu_check_refuses_at_once_without_cuda() -> None:
    import subprocess
    import sys
    import time

    root = Path(__file__).resolve().parents[2]
    t0 = time.monotonic()
    proc = subprocess.run(
        ["bash", str(root / "tests" / "gpu" / "check.sh")],
        capture_output=True,
        text=True,
        timeout=120,
        env={
            "PATH": "/usr/bin:/bin",
            "PYTHON": sys.executable,
            "DF_GPU_WORK": "/nonexistent/never-made",
        },
    )
    assert proc.returncode == 3
    assert "no CUDA device" in proc.stderr and proc.stdout == ""
    assert time.monotonic() - t0 < 60  # nothing was installed, built or run before refusing


def test_the_expression_that_compile_fuses_is_the_exact_decode() -> None:
    """[device] compile hands `_dequant_expr` to torch.compile; uncompiled it must already be bit-exact."""
    packed, scale = _random_pack(96, 192, seed=9, lo=1, hi=255)
    tables = mxfp4._device_tables(torch.device("cpu"))
    got = mxfp4._dequant_expr(packed, scale, *tables)
    assert torch.equal(
        got.view(torch.int32), mxfp4.dequantize_reference(packed, scale).view(torch.int32)
    )


@pytest.mark.parametrize(
    "cache_bytes", [0, 200_000]
)  # stream everything; keep some, evict the rest
def test_the_whole_device_path_on_cpu_gives_the_cpu_tokens(
    k3_store: Path, cache_bytes: int
) -> None:
    """Copying stager + aligned read pool + device-cache class + torch MXFP4, all at once, with device "cpu"."""
    ref = Model.open(k3_store, device="cpu", expert_bytes=cache_bytes)
    ids = ref.tokenizer.encode("The device layer")
    want, want_logits = _greedy(ref), ref.forward_logits(ids)
    ref.close()
    model = Model.open(k3_store, device="cpu", expert_bytes=cache_bytes)
    ex = model.experts
    ex.stager = staging.SyncStager(torch.device("cpu"))
    ex.reader.buffers = staging.PinnedBufferPool(1 << 24, pin=False)
    ex.cache = ex.budget.cache = device_cache.DeviceExpertCache(
        torch.device("cpu"), cache_bytes
    )  # reads reserve in it
    try:
        with mxfp4.torch_path():
            got, got_logits = _greedy(model), model.forward_logits(ids)
            again = _greedy(model)  # cache hits where the budget kept experts
    finally:
        model.close()
    assert got == want and again == want
    assert (got_logits - want_logits).abs().max() <= 1e-4 * max(1.0, float(want_logits.abs().max()))
    assert ex.cache.used_bytes <= cache_bytes
