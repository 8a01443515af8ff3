"""deltafind: run a Mixture-of-Experts model far larger than RAM on one machine.

`from deltafind import Model` is the Python API (see deltafind.api).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["Model", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy: `deltafind --help` and the control client should not pay for importing torch.
    if name == "Model":
        from deltafind.api import Model

        return Model
    raise AttributeError(name)
