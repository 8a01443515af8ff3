"""The files the daemon's runtime writes beside the engine, and where they may go.

Prompt state on disk ([cache] prompt_disk_bytes) with the answers' spellings that go
with it, so a restart reuses both; and trace files, placed in [control] trace_dir and
never inside the store, a drive folder or over the config.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deltafind import __version__
from deltafind.compose import store_dir
from deltafind.config import Settings
from deltafind.errors import RequestError
from deltafind.log import get_logger

log = get_logger(__name__)


def turns_file(scheduler: Any, ready: Any, save: bool) -> None:
    """With prompt state on disk, the answers' spellings (server/turns.py) outlive a restart too: without
    them the next turn's prompt is encoded afresh and no longer matches the state on disk."""
    disk = scheduler.core.prefix.disk if scheduler is not None else None
    if disk is None or ready is None:
        return
    path = disk.dir / "turns.safetensors"
    try:
        if save:
            ready.turns.save(path, disk.key)
        elif path.exists():
            log.info(
                "prompt_turns_loaded",
                sequences=ready.turns.load(ready.tokenizer, path, disk.key),
            )
    except Exception as e:  # a torn file: the next turns are encoded afresh, nothing worse
        log.warning("prompt_turns_not_carried", file=str(path), error=f"{type(e).__name__}: {e}")


def prompt_disk(s: Settings, model: Any) -> Any:
    """The prompt-state files ([cache] prompt_disk_bytes), keyed by what their state depends on; None when off."""
    c = s.cache
    if not c.prompt_disk_bytes or not c.prompt_bytes or model is None:
        return None
    import hashlib

    from deltafind.engine.prompt_disk import PromptDisk
    from deltafind.store.manifest import MANIFEST_NAME

    store, device = store_dir(s), next(model.net.parameters()).device
    directory = (
        Path(c.prompt_disk_dir).expanduser() if c.prompt_disk_dir else store / "prompt-cache"
    )
    sha = lambda b: hashlib.sha256(b).hexdigest()  # noqa: E731
    identity = {
        "family": model.manifest.family,
        "manifest": sha((store / MANIFEST_NAME).read_bytes()),
        "chat_template": sha(model.tokenizer.chat_template_source.encode()),
        "dtype": s.device.dtype,
        "spine_int8": str(c.spine_int8),
        "math": s.device.math,  # bf16 prefill writes other state than exact
        "device": device.type,
        "deltafind": __version__,
    }
    try:
        return PromptDisk(directory, int(c.prompt_disk_bytes), identity, device)
    except OSError as e:
        log.warning(
            "prompt_disk_off",
            dir=str(directory),
            error=str(e),
            fix="set [cache] prompt_disk_dir to a writable folder",
        )
        return None


def trace_dir(settings: Settings) -> Path:
    c = settings.control
    return Path(c.trace_dir).expanduser() if c.trace_dir else Path(c.socket).parent / "traces"


def trace_state(t: Any) -> dict[str, Any]:
    """The current (or last) trace: path, whether it is writing, bytes, dropped lines, its write error."""
    if t is None:
        return {}
    return {
        "path": str(t.path),
        "active": t.active,
        "bytes": t.bytes,
        "dropped": t.dropped,
        "error": t.error or "",
    }


def check_trace_path(path: Path, settings: Settings, model: Any, config_path: Path | None) -> None:
    """Never a trace inside the store, a drive folder or over the config (a trace_dir set there would corrupt them)."""
    target = path.resolve()
    store = store_dir(settings).resolve()
    guarded = [store, *(p.resolve() for p in model.manifest.drive_paths(store))]
    for folder in guarded:
        if target == folder or folder in target.parents:
            raise RequestError(
                f"{path}: refusing to write a trace inside the store or a drive folder ({folder}); "
                "pick a path outside it, e.g. /var/tmp/deltafind-trace.jsonl",
                "path",
            )
    if config_path is not None and target == Path(config_path).resolve():
        raise RequestError(
            f"{path}: refusing to write a trace over the daemon's config; pick another path",
            "path",
        )
