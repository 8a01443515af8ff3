"""The files of a store being set up: its lock, the resumable journal, the expert packs.

Also the checks that find what an interrupted setup left (or refuse a store of another
source) and the writes that finish a store. importer/setup.py and importer/hub_streaming.py
write stores through these.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from deltafind.errors import StoreError
from deltafind.importer.sources import Source
from deltafind.log import get_logger
from deltafind.store.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    PACK_HEADER_BYTES,
    PACK_MAGIC,
    SPINE_NAME,
    TOKENIZER_DIR,
    ExpertRecord,
    Manifest,
    pack_name,
)

log = get_logger(__name__)
JOURNAL_NAME = "setup.journal"
LOCK_NAME = ".setup.lock"


class _Journal:
    """Append-only JSONL: a header line, then one line per durable step."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.pending: list[str] = []

    def read(self) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        if not self.path.exists():
            return None, []
        lines = []
        for line in self.path.read_text().splitlines():
            try:
                lines.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a torn last line from a crash: everything before it stands
        return (lines[0] if lines else None), lines[1:]

    def start(self, header: dict[str, Any]) -> None:
        self.path.write_text(json.dumps(header) + "\n")

    def add(self, entry: dict[str, Any]) -> None:
        self.pending.append(json.dumps(entry))

    def sync(self) -> None:
        if self.pending:
            with _naming(self.path), open(self.path, "a") as f:
                f.write("\n".join(self.pending) + "\n")
                f.flush()
                os.fsync(f.fileno())
            self.pending.clear()


@contextlib.contextmanager
def store_lock(
    store_dir: Path,
    name: str = LOCK_NAME,
    busy: str = "another setup (pid {pid}) is writing this store; wait for it to finish "
    "(or stop it; a stopped setup resumes when run again)",
) -> Iterator[None]:
    """Hold the store's lock file `name` (default: setup's); a second holder is refused with `busy`
    ({pid}: the holder's)."""
    store_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(store_dir / name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise StoreError(f"{store_dir}: " + busy.format(pid=holder)) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def _naming(*paths: Any) -> Iterator[None]:
    """Name the file(s) an OSError from a write came from (file writes raise it without a name)."""
    try:
        yield
    except OSError as e:
        if e.filename is None:
            e.filename = ", ".join(map(str, paths))
        raise


@contextlib.contextmanager
def _disk_errors(store_dir: Path) -> Iterator[None]:
    # A full disk or a denied write ends setup with the path and the fix, never a traceback.
    try:
        yield
    except StoreError:
        raise
    except OSError as e:
        where = e.filename or store_dir
        if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            fix = "free space there (or pass --store/--drive on a disk with room), then run the same setup again: it resumes"
        elif isinstance(e, PermissionError):
            fix = "give this user write permission there, then run the same setup again: it resumes"
        else:
            fix = "fix the disk, then run the same setup again: it resumes where it stopped"
        raise StoreError(f"{where}: {e.strerror or e} while writing the store; {fix}") from None


def check_written(store_dir: Path) -> None:
    """Open what setup wrote before calling it ready: the manifest loads, and every layer its config counts
    has tensors in the spine or expert records. A store that fails loses its manifest (so nothing opens it)."""
    from safetensors import safe_open

    manifest = Manifest.load(store_dir)
    with safe_open(str(store_dir / SPINE_NAME), "pt") as f:
        names = list(f.keys())
    present = {r.layer for r in manifest.experts} | {
        int(n.split(".")[2]) for n in names if n.startswith("model.layers.")
    }
    layers = int(manifest.model_config.get("num_hidden_layers") or 0)
    missing = [i for i in range(layers) if i not in present]
    if missing:
        (store_dir / MANIFEST_NAME).unlink()
        raise StoreError(
            f"{store_dir}: the import wrote no tensors for layers {missing[:8]} of the {layers} its config counts; "
            "the checkpoint is incomplete (a missing shard?): fix it and run setup again"
        )


def drive_folders(store_dir: Path, drives: list[Path] | None) -> tuple[list[Path], list[str]]:
    """The drive folders (default `store_dir/drive0`) and how the manifest names them (relative when inside the store)."""
    dirs = [Path(d) for d in drives] if drives else [store_dir / "drive0"]
    root = store_dir.resolve()
    return dirs, [
        os.path.relpath(d.resolve(), root) if d.resolve().is_relative_to(root) else str(d.resolve())
        for d in dirs
    ]


def existing_store(
    store_dir: Path, params: dict[str, Any], any_slices: bool = False
) -> Manifest | None:
    """The store `store_dir` already holds from the same `params` (None if none); StoreError if it holds another.
    `any_slices`: the slice count was not asked for, so a store of any count will do (one made before the
    count was chosen by size)."""
    if not (store_dir / MANIFEST_NAME).exists():
        return None
    existing = Manifest.load(store_dir)
    if not _same_source(existing.source, params, any_slices):
        raise StoreError(
            f"{store_dir}: already holds a different store (from {existing.source.get('source')}); "
            "choose another --store or delete that folder first"
        )
    return existing


def open_journal(
    store_dir: Path, params: dict[str, Any]
) -> tuple[_Journal, str, list[dict[str, Any]]]:
    """This import's journal, the store id and the steps already done (a rerun after an interruption resumes)."""
    store_dir.mkdir(parents=True, exist_ok=True)
    journal = _Journal(store_dir / JOURNAL_NAME)
    header, done = journal.read()
    if header is not None and header.get("params") != params:
        raise StoreError(
            f"{store_dir}: holds an interrupted setup of a different source ({header.get('params', {}).get('source')}); "
            "resume it with the same --from/--drive/--dense-slices, or delete the folder"
        )
    if header is None:
        header = {"params": params, "store_id": uuid.uuid4().hex}
        journal.start(header)
    return journal, header["store_id"], done


def finish_store(
    store_dir: Path,
    checkpoint: Source,
    journal: _Journal,
    records: list[ExpertRecord],
    **fields: Any,
) -> Manifest:
    """Write the tokenizer, config.json and last the manifest (`fields` and what `checkpoint` says),
    which makes the store whole; drop the journal; open what was written (`check_written`) before any
    caller may call it ready."""
    config = checkpoint.config
    tokenizer_files = checkpoint.write_tokenizer(store_dir / TOKENIZER_DIR)
    (store_dir / "config.json").write_text(json.dumps(config, indent=1))
    manifest = Manifest(
        family=str(config.get("model_type")),
        model_config=config,
        tokenizer_files=tokenizer_files,
        experts=sorted(records, key=lambda r: r.key),
        **fields,
    )
    manifest.save(store_dir)
    journal.path.unlink(missing_ok=True)
    check_written(store_dir)
    return manifest


def _same_source(made: dict[str, Any], params: dict[str, Any], any_slices: bool) -> bool:
    """Whether a store made with `made` params is the one `params` ask for (any slice count if `any_slices`)."""
    return all(made.get(k) == v or (any_slices and k == "dense_slices") for k, v in params.items())


def _replace_older_format(
    store_dir: Path, params: dict[str, Any], any_slices: bool = False
) -> None:
    """A store of an older format from the same source and drives is removed, to be imported again."""
    try:
        old = json.loads((store_dir / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return  # Manifest.load reports it
    version = old.get("format_version")
    if version == FORMAT_VERSION or not _same_source(old.get("source", {}), params, any_slices):
        return
    log.warning("store_reimport", store=str(store_dir), old_format=version, format=FORMAT_VERSION)
    for i, d in enumerate(old.get("drives", [])):
        drive = Path(d) if Path(d).is_absolute() else store_dir / d
        for pack in [drive / pack_name(i), *drive.glob(f"experts-{i}.g*.pack")]:
            pack.unlink(missing_ok=True)
    for name in (MANIFEST_NAME, SPINE_NAME, JOURNAL_NAME):
        (store_dir / name).unlink(missing_ok=True)


def _open_packs(
    drive_dirs: list[Path], store_id: str, records: list[ExpertRecord]
) -> list[tuple[Any, int]]:
    """Open (or create) each drive's pack, truncated to the end of its last journaled record."""
    packs = []
    for idx, d in enumerate(drive_dirs):
        if not d.is_dir():
            d.mkdir(parents=True, exist_ok=True)
        path = d / pack_name(idx)
        header = json.dumps({"magic": PACK_MAGIC, "store_id": store_id, "drive": idx}).encode()
        if path.exists():
            with open(path, "rb") as f:
                got = f.read(PACK_HEADER_BYTES).rstrip(b"\0")
            if got != header:
                raise StoreError(
                    f"{path}: this drive already holds a pack of another store; give each store its own drive folder"
                )
        else:
            with open(path, "wb") as f:
                f.write(header.ljust(PACK_HEADER_BYTES, b"\0"))
        end = max(
            [e.offset + e.nbytes for r in records for e in r.extents() if e.drive == idx],
            default=PACK_HEADER_BYTES,
        )
        f = open(path, "r+b")  # noqa: SIM115 - closed by setup_store
        f.truncate(end)
        packs.append((f, end))
    return packs


def _sync_packs(packs: list[tuple[Any, int]]) -> None:
    for f, _ in packs:
        with _naming(f.name):
            f.flush()
            os.fsync(f.fileno())
