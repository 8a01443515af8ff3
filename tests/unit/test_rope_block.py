"""A decode step's rope row comes from a block of positions computed together (models/ops/rope.py): the
same bits as the position computed alone, across block edges, for each rope type."""

from __future__ import annotations

import pytest
import torch

from deltafind.models.ops.rope import Rope

PARAMS = {
    "default": {"rope_type": "default", "rope_theta": 100000.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 50000.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
}


@pytest.mark.parametrize("kind", sorted(PARAMS))
@pytest.mark.parametrize("dim", [64, 128, 48])  # 48: no block (a vector loop's tail could differ)
def test_a_decode_position_has_the_bits_of_its_own_computation(kind: str, dim: int) -> None:
    rope = Rope(PARAMS[kind], dim, 131072)
    alone = Rope(PARAMS[kind], dim, 131072)
    # in order, a jump back, a jump far ahead, and each block's edges
    for p in [*range(0, 600), 5, 1000, 100000, 100255, 100256, 99999]:
        pos = torch.tensor([p])
        cos, sin = rope.cos_sin(pos)
        want_cos, want_sin = alone.cos_sin(torch.tensor([p, p]))  # two rows: never the block
        assert cos.shape == (1, dim) and cos.is_contiguous()
        assert torch.equal(cos[0], want_cos[0]) and torch.equal(sin[0], want_sin[0]), p
    assert (rope._block is None) == (dim % 32 != 0)
