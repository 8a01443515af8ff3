"""Prefill attention on long prompts: exact against float64 softmax, and memory linear in the prompt.

`causal_attention` runs torch's CPU flash kernel (one causal pass, or a cached prefix and the new rows
as two passes merged by log-sum-exp); the reference here is the textbook softmax in float64, computed
a block of query rows at a time so that 16k-token prompts fit.
"""

from __future__ import annotations

import pytest
import torch

from deltafind.models.ops.attention import attend, causal_attention
from deltafind.models.ops.batch import Batch, SequenceCache


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, rows: torch.Tensor
) -> torch.Tensor:
    """Exact causal softmax attention in float64 for the query `rows` (indices into q's n rows)."""
    hq, n, _ = q.shape
    hkv, total, _ = k.shape
    kk = k.double().repeat_interleave(hq // hkv, 0)
    vv = v.double().repeat_interleave(hq // hkv, 0)
    out = []
    for block in rows.split(256):
        s = q[:, block].double() @ kk.transpose(1, 2) * scale  # [Hq, b, L]
        seen = (
            torch.arange(total)[None, :] <= (total - n + block)[:, None]
        )  # row i sits at total - n + i
        out.append(torch.softmax(s.masked_fill(~seen, float("-inf")), -1) @ vv)
    return torch.cat(out, 1)


CASES = {  # (q heads, kv heads, q.k width, v width, cached rows, new rows)
    "gqa-1k-whole": (9, 3, 64, 64, 0, 1024),
    "gqa-prefix": (8, 2, 64, 64, 1500, 548),
    "mla-widths-4k-whole": (2, 2, 24, 16, 0, 4096),
    "mla-widths-16k-after-12k": (2, 2, 24, 16, 12288, 4096),
    "verify-rows-after-prefix": (4, 1, 32, 32, 3000, 5),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_prefill_attention_equals_float64_softmax(case: str) -> None:
    hq, hkv, d, dv, cached, n = CASES[case]
    g = torch.Generator().manual_seed(len(case))
    total = cached + n
    q, k, v = (
        torch.randn(h, t, w, generator=g)
        for h, t, w in ((hq, n, d), (hkv, total, d), (hkv, total, dv))
    )
    got = causal_attention(q, k, v, d**-0.5)
    assert got.shape == (hq, n, dv) and got.dtype == torch.float32
    rows = torch.cat(
        [torch.arange(min(n, 256)), torch.arange(max(n - 256, 0), n)]
    ).unique()  # first and last rows
    torch.testing.assert_close(
        got[:, rows].double(), _reference(q, k, v, d**-0.5, rows), atol=2e-5, rtol=0
    )


def test_no_new_rows_give_an_empty_result() -> None:
    """Zero rows after a cache: torch's flash kernel divides by the row count (SIGFPE, the whole process)."""
    out = causal_attention(torch.randn(2, 0, 8), torch.randn(2, 5, 8), torch.randn(2, 5, 4), 0.3)
    assert out.shape == (2, 0, 4)


def _peak_growth_bytes(fn) -> int:
    """Peak RSS over the RSS before `fn` ran (the kernel's high-water mark, reset first)."""

    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = status("VmRSS:")
    fn()
    return status("VmHWM:") - before


def test_prefill_memory_is_linear_in_the_prompt() -> None:
    """8k new rows through `attend` (a cache and a Batch, as a model runs it), whole and after a 4k prefix:
    the old path's [heads, n, L] fp32 scores alone were 512 MiB here, and 4x that at twice the rows."""
    t, heads, d = 8192, 2, 24
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(t, heads, d, generator=g) for _ in range(3))

    def run(splits: list[int]) -> None:
        cache, start = SequenceCache(1), 0
        for n in splits:
            batch = Batch.of([(cache, n)])
            attend(q[start : start + n], k[start : start + n], v[start : start + n], batch, 0)
            batch.advance()
            start += n

    for splits in ([t], [4096, 4096]):
        growth = _peak_growth_bytes(lambda s=splits: run(s))
        assert growth < 48 << 20, (
            f"{splits}: {growth >> 20} MiB"
        )  # k/v cache 3 MiB, outputs 1.5 MiB, kernel buffers
