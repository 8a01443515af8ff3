"""Re-verify a store without loading the model: manifest, spine and every expert record."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from deltafind.errors import DeltafindError
from deltafind.store.manifest import SPINE_NAME, Manifest
from deltafind.store.reader import PackReader


@dataclass
class DoctorReport:
    store: Path
    experts_checked: int = 0
    bytes_checked: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def check_store(store_dir: Path, progress: bool = True) -> DoctorReport:
    store_dir = Path(store_dir)
    report = DoctorReport(store_dir)
    manifest = Manifest.load(store_dir)
    spine = store_dir / SPINE_NAME
    h = hashlib.sha256()
    try:
        with open(spine, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        if h.hexdigest() != manifest.spine_sha256:
            report.problems.append(f"{spine}: checksum mismatch (the spine is corrupt; re-run setup)")
    except OSError as e:
        report.problems.append(f"{spine}: unreadable ({e.strerror})")
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
