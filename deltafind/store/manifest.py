"""The store's table of contents: `manifest.json`, its schema and atomic writes.

A store folder holds `manifest.json`, `spine.safetensors`, `tokenizer/` and,
on each drive folder, one pack file of 4096-byte-aligned expert records. The
manifest is written last, atomically: a folder without one is not a store.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from deltafind.errors import StoreError

FORMAT_VERSION = 2  # 2: GGUF blocks kept as stored (quant tags); 1 widened them to fp32 at import
MANIFEST_NAME = "manifest.json"
SPINE_NAME = "spine.safetensors"
TOKENIZER_DIR = "tokenizer"
ALIGN = 4096
PACK_HEADER_BYTES = ALIGN
PACK_MAGIC = "deltafind-pack"
PLACEMENTS = ("whole", "stripe")


def pack_name(drive_idx: int, generation: int = 0) -> str:
    """A drive's pack file; `trace warm --rebalance` writes generation N+1 beside N, then switches."""
    return (
        f"experts-{drive_idx}.pack"
        if generation == 0
        else f"experts-{drive_idx}.g{generation}.pack"
    )


def align_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


@dataclass(frozen=True)
class TensorEntry:
    name: str  # gate_proj | up_proj | down_proj
    dtype: str  # torch dtype name without "torch.", e.g. float32, bfloat16
    shape: tuple[int, ...]
    offset: int  # from the record start
    nbytes: int
    quant: str = (
        ""  # GGUF blocks: "KIND/COLS" (store/quant.py); the tensor is uint8 [rows, row_bytes]
    )


class Extent(NamedTuple):
    """A contiguous piece of a record on one drive: `nbytes` (a multiple of ALIGN) at `offset` of its pack."""

    drive: int
    offset: int
    nbytes: int


@dataclass(frozen=True)
class ExpertRecord:
    layer: int
    expert: int
    drive: int  # a whole record's drive; a striped record's first stripe's
    offset: int  # absolute offset in that drive's pack, multiple of ALIGN
    length: int  # payload bytes (the record occupies align_up(length) bytes)
    sha256: str
    tensors: tuple[TensorEntry, ...]
    xxh3: str | None = None  # xxh3_64 of the payload: the per-read check (sha256 stays for doctor)
    # Striped placement (manifest placement "stripe"): the record's aligned bytes, in order, as
    # pieces on several drives, read in parallel (RAID 0 per record). Empty: whole at (drive, offset).
    stripes: tuple[Extent, ...] = ()

    @property
    def key(self) -> tuple[int, int]:
        return (self.layer, self.expert)

    def extents(self) -> tuple[Extent, ...]:
        """Where the record's align_up(length) bytes lie, in payload order."""
        return self.stripes or (Extent(self.drive, self.offset, align_up(self.length)),)

    def loads(self) -> list[tuple[int, int]]:
        """(drive, bytes) a read of the record puts on each drive it loads: a striped record, its share on each."""
        extents = self.extents()
        return [(ex.drive, self.length // len(extents)) for ex in extents]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["tensors"] = [
            {k: v for k, v in asdict(t).items() if k != "quant" or v} for t in self.tensors
        ]
        if self.stripes:
            d["stripes"] = [list(e) for e in self.stripes]
        else:
            del d["stripes"]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ExpertRecord:
        tensors = tuple(
            TensorEntry(
                t["name"],
                t["dtype"],
                tuple(t["shape"]),
                t["offset"],
                t["nbytes"],
                t.get("quant", ""),
            )
            for t in d["tensors"]
        )
        stripes = tuple(Extent(*e) for e in d.get("stripes", ()))
        return cls(
            d["layer"],
            d["expert"],
            d["drive"],
            d["offset"],
            d["length"],
            d["sha256"],
            tensors,
            d.get("xxh3"),
            stripes,
        )


@dataclass
class Manifest:
    store_id: str
    family: str
    model_config: dict[str, Any]
    drives: list[str]  # drive folders; relative paths are relative to the store folder
    dense_slices: int
    source: dict[str, Any]
    spine_sha256: str
    tokenizer_files: list[str]
    experts: list[ExpertRecord] = field(default_factory=list)
    format_version: int = FORMAT_VERSION
    pack_generation: int = 0  # which pack files hold the records (see pack_name)
    # "whole": each record on one drive (round-robin, or by heat after a rebalance); "stripe": records
    # large enough are split over all drives (importer/placement.py). Absent from a "whole" manifest, so
    # older deltafind still opens those and refuses striped ones ("malformed manifest").
    placement: str = "whole"

    def drive_paths(self, store_dir: Path) -> list[Path]:
        return [(store_dir / d) if not os.path.isabs(d) else Path(d) for d in self.drives]

    def expert_counts(self) -> dict[int, int]:
        counts: dict[int, int] = {}
        for r in self.experts:
            counts[r.layer] = max(counts.get(r.layer, 0), r.expert + 1)
        return counts

    def expert_bytes(self) -> int:
        return sum(r.length for r in self.experts)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["experts"] = [r.to_json() for r in self.experts]
        if not self.pack_generation:
            del d["pack_generation"]  # a never-rebalanced store stays readable by older deltafind
        if self.placement == "whole":
            del d["placement"]
        return d

    def save(self, store_dir: Path) -> None:
        write_json_atomic(store_dir / MANIFEST_NAME, self.to_json())

    @classmethod
    def load(cls, store_dir: Path) -> Manifest:
        path = Path(store_dir) / MANIFEST_NAME
        if not os.access(store_dir, os.X_OK) and Path(store_dir).is_dir():
            raise StoreError(no_permission(Path(store_dir), "search (x)"))
        if not path.exists():
            hint = (
                " (setup did not finish: run `deltafind setup` again to resume)"
                if (Path(store_dir) / "setup.journal").exists()
                else ""
            )
            raise StoreError(
                f"{store_dir}: not a deltafind store: {MANIFEST_NAME} is missing{hint}; create one with `deltafind setup --from CHECKPOINT --store {store_dir}`"
            )
        try:
            d = json.loads(path.read_text())
        except PermissionError:
            raise StoreError(no_permission(path, "read")) from None
        except (OSError, json.JSONDecodeError) as e:
            raise StoreError(
                f"{path}: unreadable manifest ({e}); re-run `deltafind setup` into a fresh --store"
            ) from e
        version = d.get("format_version")
        if version != FORMAT_VERSION:
            raise StoreError(
                f"{path}: store format_version {version!r}, this deltafind reads {FORMAT_VERSION}; re-import the model: "
                f"run the same `deltafind setup` again (it replaces a store of an older format from the same source)"
            )
        if d.get("placement", "whole") not in PLACEMENTS:
            raise StoreError(
                f"{path}: unknown expert placement {d['placement']!r} (this deltafind knows {', '.join(PLACEMENTS)}); "
                "upgrade deltafind, or re-run `deltafind setup` into a fresh --store"
            )
        try:
            d["experts"] = [ExpertRecord.from_json(r) for r in d["experts"]]
            return cls(**d)
        except (KeyError, TypeError) as e:
            raise StoreError(
                f"{path}: malformed manifest ({e}); re-run `deltafind setup` into a fresh --store"
            ) from e


def current_umask() -> int:
    """This process's umask (read without changing it where /proc says it)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def no_permission(path: Path, permission: str) -> str:
    """Which user lacks which permission on `path`, its owner and mode, and the fix (never "re-run setup")."""
    import getpass
    import grp
    import pwd
    import stat

    try:
        st = path.stat()
        owner = f"{pwd.getpwuid(st.st_uid).pw_name}:{grp.getgrgid(st.st_gid).gr_name}"
        where = f"owner {owner}, mode {stat.S_IMODE(st.st_mode):04o}"
    except (OSError, KeyError):
        where = "owner and mode unreadable"
    return (
        f"{path}: permission denied: user {getpass.getuser()} has no {permission} permission on it ({where}); "
        f"grant it (for example `chmod -R a+rX {path.parent if path.is_file() else path}`, or add the service user to "
        "the owning group), or run as the user that owns the store"
    )


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write JSON next to `path`, fsync, then rename over it: readers see old or new, never half.

    The file gets the mode a plain open() would (0666 less the umask, so 0644 by default):
    a service user reads a store that root made.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~current_umask())  # mkstemp makes 0600
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def file_digest(path: Path, h: Any, chunk_bytes: int = 16 << 20) -> str:
    """The hex digest of `path`'s bytes in hash object `h`, read `chunk_bytes` at a time."""
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (files created, renamed, deleted in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
