"""GPU tests: the device paths on CUDA (or MPS) against the CPU path of the same code.

Every test here is marked `gpu` (deselected by default; `make test-gpu` or
tests/gpu/check.sh selects them) and skips cleanly where no accelerator exists.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltafind.device.select import cuda_unavailable_reason, mps_unavailable_reason
from deltafind.importer.setup import setup_store
from deltafind.importer.synthetic import open_synthetic
from deltafind.models.registry import family_module


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.gpu)


@pytest.fixture(scope="session")
def accel() -> torch.device:
    """The accelerator under test: CUDA first, then MPS; skip without one."""
    if cuda_unavailable_reason() is None:
        return torch.device("cuda", 0)
    if mps_unavailable_reason() is None:
        return torch.device("mps")
    pytest.skip(f"no accelerator: {cuda_unavailable_reason()}; {mps_unavailable_reason()}")


@pytest.fixture(scope="session")
def cuda(accel: torch.device) -> torch.device:
    if accel.type != "cuda":
        pytest.skip("needs CUDA (pinned memory, streams, events)")
    return accel


def _store(tmp_path_factory: pytest.TempPathFactory, family: str, seed: int, drives: int) -> Path:
    root = tmp_path_factory.mktemp(f"gpu-{family}")
    source = open_synthetic(family, "tiny", seed=seed)
    fam = family_module(family)
    setup_store(
        source,
        root / "s",
        [root / f"d{i}" for i in range(drives)],
        dense_slices=2,
        progress=False,
        names=fam.weight_names(fam.ModelArgs.from_config(source.config)),
    )
    return root / "s"


@pytest.fixture(scope="session", params=["kimi_k3", "qwen3_moe", "llama"])
def tiny_store(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, accel: torch.device
) -> Path:
    return _store(tmp_path_factory, request.param, seed=3, drives=2)


@pytest.fixture(scope="session")
def k3_store(tmp_path_factory: pytest.TempPathFactory, accel: torch.device) -> Path:
    return _store(tmp_path_factory, "kimi_k3", seed=3, drives=2)
