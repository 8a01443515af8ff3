"""Stream tensors into a safetensors file one at a time (the spine may not fit in RAM)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch

from deltafind.store.quant import SPINE_METADATA_KEY
from deltafind.store.sources import TensorInfo

_DTYPE_CODES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


def write_safetensors(path: Path, tensors: dict[str, TensorInfo], load: Callable[[str], torch.Tensor]) -> str:
    """Write `tensors` (metadata known up front) to `path`; return the file's sha256."""
    meta = {"format": "pt", "writer": "deltafind"}
    quants = {name: info.quant for name, info in tensors.items() if info.quant}
    if quants:
        meta[SPINE_METADATA_KEY] = json.dumps(quants, sort_keys=True)
    header: dict[str, object] = {"__metadata__": meta}
    offset = 0
    names = sorted(tensors)
    for name in names:
        info = tensors[name]
        header[name] = {"dtype": _DTYPE_CODES[info.dtype], "shape": list(info.shape), "data_offsets": [offset, offset + info.nbytes]}
        offset += info.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    h = hashlib.sha256()
    with open(path, "wb") as f:
        for chunk in (len(raw).to_bytes(8, "little"), raw):
            f.write(chunk)
            h.update(chunk)
        for name in names:
            t = load(name).to(tensors[name].dtype).contiguous()
            if tuple(t.shape) != tensors[name].shape:
                raise ValueError(f"tensor {name}: shape {tuple(t.shape)} differs from its metadata {tensors[name].shape}")
            data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            f.write(data)
            h.update(data)
        f.flush()
        os.fsync(f.fileno())
    return h.hexdigest()
