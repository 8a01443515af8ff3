"""Map an HF `model_type` to its family module (each exports ModelArgs and Model)."""

from __future__ import annotations

import importlib
from types import ModuleType

from deltafind.errors import UnsupportedModelError

FAMILIES = {
    "llama": "deltafind.models.llama",
    "qwen2": "deltafind.models.qwen2",
    "qwen3": "deltafind.models.qwen3",
    "qwen3_moe": "deltafind.models.qwen3_moe",
    "deepseek_v3": "deltafind.models.deepseek_v3",
    "kimi_k2": "deepseek_v3",
    "kimi_k3": "deltafind.models.kimi_k3",
    "olmoe": "deltafind.models.olmoe",
}


def family_module(model_type: str) -> ModuleType:
    target = FAMILIES.get(model_type)
    if target is None:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported (supported: {', '.join(sorted(FAMILIES))})"
        )
    if not target.startswith("deltafind."):  # an alias
        return family_module(target)
    return importlib.import_module(target)
