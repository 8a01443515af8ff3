"""How a streaming store's missing experts are cut into range requests (store/remote_experts.py).

`plan_ranges` on the layouts the hubs hold: a GGUF stacks a layer's experts in each of
`ffn_{gate,up,down}_exps`, so one expert's three tensors lie a whole tensor apart; a safetensors
shard keeps an expert's tensors back to back.
"""

from __future__ import annotations

import random

from deltafind.store.remote_experts import MAX_GAP_BYTES, Part, plan_ranges


def _fetched(runs: list[list[Part]]) -> int:
    return sum(max(p.end for p in run) - run[0].start for run in runs)


def _gguf_expert(e: int, size: int, experts: int = 8) -> list[Part]:
    """Expert `e`'s gate, up and down slices of three stacked tensors of `experts` slices each."""
    return [
        Part("m.gguf", t * experts * size + e * size, t * experts * size + (e + 1) * size)
        for t in range(3)
    ]


def test_tiny_gguf_experts_fetch_only_their_own_bytes() -> None:
    parts = _gguf_expert(
        2, 36_864
    )  # a Q4_K 256x256 slice: 7 other experts (258 KiB) between tensors
    runs = plan_ranges(parts)
    assert [len(r) for r in runs] == [1, 1, 1] and _fetched(runs) == 3 * 36_864
    both = plan_ranges(_gguf_expert(2, 36_864) + _gguf_expert(3, 36_864))
    assert [len(r) for r in both] == [2, 2, 2] and _fetched(
        both
    ) == 6 * 36_864  # neighbours: one range


def test_small_gaps_are_bridged_by_at_most_the_part_after_them() -> None:
    a, b = Part("f", 0, 100), Part("f", 200, 300)
    assert plan_ranges([b, a]) == [[a, b]]  # a 100-byte gap before a 100-byte part
    c = Part("f", 201, 300)
    assert plan_ranges([a, c]) == [[a], [c]]  # 101 > 99
    assert plan_ranges([a, Part("g", 100, 200)]) == [[a], [Part("g", 100, 200)]]  # another file
    big = 4 * MAX_GAP_BYTES
    x, y = Part("f", 0, big), Part("f", big + MAX_GAP_BYTES + 1, 2 * big)
    assert plan_ranges([x, y]) == [[x], [y]]  # never more than MAX_GAP_BYTES, however large
    z = Part("f", big + MAX_GAP_BYTES, 2 * big)
    assert plan_ranges([x, z]) == [[x, z]]


def test_no_plan_fetches_more_than_twice_what_it_needs() -> None:
    rng = random.Random(0)
    for _ in range(200):
        parts, pos = [], 0
        for _ in range(rng.randint(1, 30)):
            pos += rng.choice([0, rng.randint(1, 4096), rng.randint(1, 3 << 20)])
            size = rng.choice([rng.randint(1, 4096), rng.randint(1, 2 << 20)])
            parts.append(Part(rng.choice("ab"), pos, pos + size))
            pos += size
        runs = plan_ranges(parts)
        assert [p for r in runs for p in r] == sorted(parts, key=lambda p: (p.file, p.start))
        assert _fetched(runs) <= 2 * sum(p.end - p.start for p in parts)
