"""deltafind: run a Mixture-of-Experts model far larger than RAM on one machine.

`from deltafind import Model` is the Python API (see deltafind.api).
"""

from __future__ import annotations

import os
from typing import Any

# OpenMP workers spin after each parallel region by default; on a few cores that spinning
# starves the drive reader threads (measured: 6x slower streamed decode on 2 cores, see
# tests/bench/RESULTS.md). libgomp reads this once, when torch loads it; a user's value wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# MKL (torch's CPU BLAS) otherwise picks its code path by the operands' memory alignment, so at 2+
# threads one F.linear on the same numbers could round differently in another buffer: a prompt resumed
# from the prefix cache gave other logits than the same chunks run cold. AUTO keeps one path per CPU
# and thread count (measured: no slowdown, tests/bench/RESULTS.md). Read at MKL's first call.
os.environ.setdefault("MKL_CBWR", "AUTO")

__version__ = "0.1.0"
__all__ = ["Model", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy: `deltafind --help` and the control client should not pay for importing torch.
    if name == "Model":
        from deltafind.api import Model

        return Model
    raise AttributeError(name)
