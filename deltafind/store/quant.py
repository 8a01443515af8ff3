"""llama.cpp's block formats as the store keeps them: a tag per tensor, row sizes, column slices.

A GGUF-quantized matrix of logical shape [rows, cols] is stored as its blocks, uint8
[rows, row_bytes], with the tag "KIND/COLS" (e.g. "Q4_1/576") in the spine's safetensors
metadata or the expert record's tensor entry. Blocks run along a row, so rows can be
permuted or split freely and columns only at block boundaries. Knows bytes, not math:
models/ops/stored.py computes on them.
"""

from __future__ import annotations

import torch

from deltafind.errors import StoreError

# kind -> (weights per block, bytes per block), as gguf.GGML_QUANT_SIZES has them
BLOCKS = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "Q2_K": (256, 84),
    "Q3_K": (256, 110),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
    "IQ1_S": (256, 50),
    "IQ1_M": (256, 56),
    "IQ2_XXS": (256, 66),
    "IQ2_XS": (256, 74),
    "IQ2_S": (256, 82),
    "IQ3_XXS": (256, 98),
    "IQ3_S": (256, 110),
    "IQ4_NL": (32, 18),
    "IQ4_XS": (256, 136),
}
SPINE_METADATA_KEY = (
    "deltafind.quant"  # in spine.safetensors' __metadata__: JSON {tensor name: tag}
)


def quant_tag(kind: str, cols: int) -> str:
    return f"{kind}/{cols}"


def parse_quant(tag: str) -> tuple[str, int]:
    """(kind, cols) of a tag; StoreError naming the tag when it is not one."""
    kind, _, cols = tag.partition("/")
    if kind not in BLOCKS or not cols.isdigit() or int(cols) % BLOCKS[kind][0]:
        raise StoreError(
            f"quantized tensor tag {tag!r} is not KIND/COLS with KIND in {sorted(BLOCKS)}; re-import the store"
        )
    return kind, int(cols)


def row_bytes(kind: str, cols: int) -> int:
    per, size = BLOCKS[kind]
    return cols // per * size


def slice_cols(raw: torch.Tensor, tag: str, start: int, stop: int) -> tuple[torch.Tensor, str]:
    """Columns [start, stop) of a block matrix, and the slice's tag; the bounds must fall on blocks."""
    kind, _ = parse_quant(tag)
    per, size = BLOCKS[kind]
    if start % per or stop % per:
        raise StoreError(
            f"cannot split {kind} blocks of {per} weights at columns {start}..{stop}; "
            f"choose --dense-slices so each slice is a multiple of {per} columns"
        )
    return raw[:, start // per * size : stop // per * size].contiguous(), quant_tag(
        kind, stop - start
    )
