"""Stream tensors into a safetensors file one at a time (the spine may not fit in RAM)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from deltafind.importer.sources import TensorInfo
from deltafind.store.manifest import fsync_dir
from deltafind.store.quant import SPINE_METADATA_KEY

_DTYPE_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def write_safetensors(
    path: Path,
    tensors: dict[str, TensorInfo],
    load: Callable[[str], torch.Tensor],
    resume: bool = False,
) -> str:
    """Write `tensors` (metadata known up front) to `path`; return the file's sha256.

    `resume`: keep the whole tensors an interrupted write of the same header left in `path`
    and load only the rest (a streaming install fetches each tensor over the network).
    """
    meta = {"format": "pt", "writer": "deltafind"}
    quants = {name: info.quant for name, info in tensors.items() if info.quant}
    if quants:
        meta[SPINE_METADATA_KEY] = json.dumps(quants, sort_keys=True)
    header: dict[str, object] = {"__metadata__": meta}
    offset = 0
    names = sorted(tensors)
    for name in names:
        info = tensors[name]
        header[name] = {
            "dtype": _DTYPE_CODES[info.dtype],
            "shape": list(info.shape),
            "data_offsets": [offset, offset + info.nbytes],
        }
        offset += info.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    head = len(raw).to_bytes(8, "little") + raw
    h = hashlib.sha256()
    kept = _resumable(path, head, [tensors[n].nbytes for n in names], h) if resume else -1
    with open(path, "ab" if kept >= 0 else "wb") as f:
        if kept < 0:
            f.write(head)
            h.update(head)
        for name in names[max(kept, 0) :]:
            t = load(name).to(tensors[name].dtype).contiguous()
            if tuple(t.shape) != tensors[name].shape:
                raise ValueError(
                    f"tensor {name}: shape {tuple(t.shape)} differs from its metadata {tensors[name].shape}"
                )
            data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            f.write(data)
            h.update(data)
        f.flush()
        os.fsync(f.fileno())
    return h.hexdigest()


def stage_tensors(
    dest: Path, tensors: dict[str, TensorInfo], load: Callable[[str], torch.Tensor]
) -> Any:
    """Write `tensors` to `dest` durably (a temporary name, then renamed) and open it: a source's
    spine tensors kept in the store before `--delete-source` frees the file they came from."""
    from safetensors import safe_open

    tmp = dest.with_name(dest.name + ".tmp")
    write_safetensors(tmp, tensors, load)
    os.replace(tmp, dest)
    fsync_dir(dest.parent)
    return safe_open(str(dest), "pt")


def _resumable(path: Path, head: bytes, sizes: list[int], h: Any) -> int:
    """How many whole tensors `path` holds after `head` (-1: none reusable); hashes and keeps exactly those."""
    try:
        with open(path, "rb") as f:
            if f.read(len(head)) != head:
                return -1
            have, keep, count = os.fstat(f.fileno()).st_size - len(head), len(head), 0
            for size in sizes:
                if have < size:
                    break
                have, keep, count = have - size, keep + size, count + 1
            f.seek(0)
            left = keep
            while left:
                chunk = f.read(min(left, 1 << 24))
                h.update(chunk)
                left -= len(chunk)
    except FileNotFoundError:
        return -1
    os.truncate(path, keep)
    return count
