"""Model.open's keywords as `Settings`: the Python API's overrides on top of the config file.

`Model.open(store, expert_cache_bytes=..., prefetch=..., drives=..., draft=...)` and `run`/`bench`
flags name settings more simply than the TOML does; this turns them into the one `Settings` that
the wiring (api.py) reads, so every entry point opens a model from the same place.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import ValidationError

from deltafind.config import ByteSize, DraftSettings, Settings, load_settings
from deltafind.errors import ConfigError, StoreError
from deltafind.store.manifest import Manifest
from deltafind.store.prefetch_gate import PrefetchOptions

SIMPLE_OVERRIDES = {  # Model.open keyword -> (settings section, key)
    "device": ("device", "kind"), "dtype": ("device", "dtype"), "compile_kernels": ("device", "compile"),
    "threads": ("device", "threads"), "expert_cache_bytes": ("cache", "expert_bytes"), "pin_bytes": ("cache", "pin_bytes"),
    "spine_bytes": ("cache", "spine_bytes"), "heat_decay": ("cache", "heat_decay"), "draft_max_width": ("draft", "max_width"),
    "spine_int8": ("cache", "spine_int8"), "read_mode": ("cache", "read_mode"),
    "max_prefill_tokens": ("server", "max_prefill_tokens"),
}


def draft_settings(spec: str, max_width: int | None = None) -> DraftSettings:
    """A `--draft` value as `[draft]`: off; auto (draft while it pays); any named source, forced on."""
    mode = spec if spec in ("off", "auto") else "on"
    fields = {"mode": mode, "source": "auto" if mode == "off" else spec}
    return DraftSettings(**fields, **({"max_width": max_width} if max_width else {}))


def settings_with(settings: Settings | None, store_dir: str | Path | None, overrides: dict[str, Any]) -> Settings:
    """`settings` (default: `load_settings()` with drafting off) with Model.open's simple keywords on top."""
    nested: dict[str, dict[str, Any]] = {"model": {"store": Path(store_dir).expanduser()}} if store_dir else {}
    for key, value in overrides.items():
        if key == "prefetch":
            p = value if isinstance(value, PrefetchOptions) else PrefetchOptions(enabled=bool(value))
            nested["prefetch"] = {"enabled": p.enabled, "max_in_flight": p.max_in_flight, "recall_threshold": p.recall_threshold}
        elif key == "drives":
            nested["drives"] = value  # type: ignore[assignment]  # DriveOptions, resolved below
        elif key == "draft":
            nested["draft"] = draft_settings(value).model_dump()
        elif key in SIMPLE_OVERRIDES:
            section, name = SIMPLE_OVERRIDES[key]
            nested.setdefault(section, {})[name] = value
        else:
            raise TypeError(f"Model.open() got an unexpected keyword {key!r} (expected one of "
                            f"{', '.join([*SIMPLE_OVERRIDES, 'prefetch', 'drives', 'draft'])}, or settings=)")
    if settings is None:
        nested.setdefault("draft", {"mode": "off"})  # the Python API drafts only when asked
    data = (settings or load_settings()).model_dump()
    for section, values in nested.items():
        data[section] = values if section == "drives" else {**data[section], **values}
    if data["model"]["store"] is None:
        raise StoreError("no store to open: pass its folder, or set [model] store")
    if "drives" in nested:
        store = Path(data["model"]["store"]).expanduser()
        paths = Manifest.load(store).drive_paths(store)
        data["drives"] = [{"path": d.path or paths[i], "queue_depth": d.queue_depth, "read_mb_s": d.read_mb_s}
                          for i, d in enumerate(nested["drives"])]  # type: ignore[arg-type]
    pin = data["cache"].pop("pin_bytes", 0)  # the API may pin past the LRU's budget (the pin tier sits beside it)
    try:
        out = Settings.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"Model.open: {e}") from None
    return out.model_copy(update={"cache": out.cache.model_copy(update={"pin_bytes": ByteSize(pin)})})
