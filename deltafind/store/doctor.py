"""Re-verify a store without loading the model: manifest, spine and every expert record."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from deltafind.errors import DeltafindError
from deltafind.store.manifest import SPINE_NAME, Manifest, file_digest, no_permission, pack_name
from deltafind.store.reader import PackReader


@dataclass
class DoctorReport:
    store: Path
    experts_checked: int = 0
    bytes_checked: int = 0
    problems: list[str] = field(default_factory=list)
    reading: str = (
        ""  # what the import recorded it runs, where not the release (importer/gguf_k3.py)
    )

    @property
    def ok(self) -> bool:
        return not self.problems


def _drive_problems(manifest: Manifest, store_dir: Path) -> dict[int, str]:
    """Every drive whose pack is missing or unreadable, each with its own message."""
    out: dict[int, str] = {}
    for idx, folder in enumerate(manifest.drive_paths(store_dir)):
        pack = folder / pack_name(idx, manifest.pack_generation)
        if (closed := _unsearchable(folder)) is not None:
            out[idx] = f"drive {idx} ({folder}): " + no_permission(closed, "search (x)")
        elif not folder.is_dir():
            out[idx] = (
                f"drive {idx} ({folder}) is missing: mount it, or fix the store's drive list in [[drives]]"
            )
        elif not os.access(pack, os.F_OK):
            out[idx] = f"drive {idx}: {pack} is missing; is the right drive mounted at {folder}?"
        elif not os.access(pack, os.R_OK):
            out[idx] = no_permission(pack, "read")
    return out


def _unsearchable(folder: Path) -> Path | None:
    """The folder on the way to `folder` (or itself) this user cannot search: a folder there but closed is not missing."""
    for path in [*reversed(folder.parents), folder]:
        try:
            os.stat(path)
        except PermissionError:
            return path.parent
        except OSError:
            return None
        if path.is_dir() and not os.access(path, os.X_OK):
            return path
    return None


def check_store(store_dir: Path, progress: bool = True) -> DoctorReport:
    store_dir = Path(store_dir)
    report = DoctorReport(store_dir)
    manifest = Manifest.load(store_dir)
    report.reading = str(manifest.model_config.get("gguf_reading") or "")
    spine = store_dir / SPINE_NAME
    try:
        if file_digest(spine, hashlib.sha256(), 1 << 22) != manifest.spine_sha256:
            report.problems.append(
                f"{spine}: checksum mismatch (the spine is corrupt; re-run setup)"
            )
    except PermissionError:
        report.problems.append(no_permission(spine, "read"))
    except OSError as e:
        report.problems.append(f"{spine}: unreadable ({e.strerror})")
    missing = _drive_problems(manifest, store_dir)
    if missing:  # report every drive that is gone, not only the first
        report.problems += list(missing.values())
        skipped = sum(1 for r in manifest.experts if any(e.drive in missing for e in r.extents()))
        report.problems.append(
            f"{skipped} expert record(s) on drive(s) {', '.join(map(str, sorted(missing)))} not verified; "
            "fix the drives above and run doctor again"
        )
        return report
    try:
        reader = PackReader(manifest, store_dir)
    except DeltafindError as e:
        report.problems.append(str(e))
        return report
    try:
        for rec in tqdm(manifest.experts, unit="expert", desc="verify", disable=not progress):
            if reader.remote is not None and rec.key not in reader.remote.present:
                continue  # a streaming install's expert not fetched yet: nothing on disk to check
            try:
                reader.read(rec)
                report.experts_checked += 1
                report.bytes_checked += rec.length
            except DeltafindError as e:
                report.problems.append(str(e))
    finally:
        reader.close()
    return report
