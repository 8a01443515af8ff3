"""A dense layer's slices: today's `SlicedMLP` (the direct sum plus a reported route)
vs the loop it had before, and vs routing every token to every slice through `moe.dispatch`.

All three run on the same tensors, side by side in one run, are checked bit for bit, and
one JSON line per token count gives each one's best time and ratio to the old loop.

    python tests/bench/bench_sliced_dispatch.py [--hidden 576 --inter 1536 --slices 8]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from deltafind.models.ops.gated_mlp import swiglu
from deltafind.models.ops.moe import SlicedMLP, dispatch
from deltafind.provider import DictExpertProvider


def old_expert_forward(
    x: torch.Tensor, expert, act
) -> torch.Tensor:  # gated_mlp.expert_forward before slices were dispatched as one matmul
    dtype = x.dtype
    gate = F.linear(x, expert["gate_proj"].to(dtype))
    up = F.linear(x, expert["up_proj"].to(dtype))
    return F.linear(act(gate) * up, expert["down_proj"].to(dtype))


def before(
    x: torch.Tensor, provider: DictExpertProvider, act
) -> torch.Tensor:  # the pre-issue-11 SlicedMLP.forward
    ids = list(range(provider.num_experts(0)))
    partial = {e: old_expert_forward(x, ex, act) for e, ex in provider.fetch(0, ids)}
    out = torch.zeros_like(x)
    for e in ids:
        out += partial[e]
    return out


def best_of(fn, reps: int) -> float:
    """Best CPU time of this process (one thread): other processes on a shared box do not count."""
    times = []
    for _ in range(reps):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=576)  # SmolLM2-135M, the demo
    ap.add_argument("--inter", type=int, default=1536)
    ap.add_argument("--slices", type=int, default=8)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    w = args.inter // args.slices
    provider = DictExpertProvider(
        {
            (0, s): {
                "gate_proj": torch.randn(w, args.hidden) / 24,
                "up_proj": torch.randn(w, args.hidden) / 24,
                "down_proj": torch.randn(args.hidden, w) / 24,
            }
            for s in range(args.slices)
        }
    )
    now, run = SlicedMLP(0, provider, swiglu("silu")), swiglu("silu")

    def via_dispatch(x: torch.Tensor) -> torch.Tensor:
        idx = torch.arange(args.slices).expand(x.shape[0], -1)
        return dispatch(x, idx, torch.ones(idx.shape), provider, 0, run)

    for tokens in (1, 8, 128):
        x = torch.randn(tokens, args.hidden)
        with torch.inference_mode():
            ref = before(x, provider, torch.nn.functional.silu)
            assert torch.equal(now(x), ref) and torch.equal(via_dispatch(x), ref)
            times = {}
            for _ in range(args.rounds):  # interleaved rounds: a busy machine slows all three alike
                for name, fn in (
                    ("before", lambda x=x: before(x, provider, torch.nn.functional.silu)),
                    ("now", lambda x=x: now(x)),
                    ("dispatch", lambda x=x: via_dispatch(x)),
                ):
                    times[name] = min(times.get(name, 1e9), best_of(fn, args.reps))
        print(
            json.dumps(
                {
                    "tokens": tokens,
                    "slices": args.slices,
                    **{f"{k}_ms": round(v * 1e3, 4) for k, v in times.items()},
                    "now_vs_before": round(times["now"] / times["before"], 3),
                    "dispatch_vs_before": round(times["dispatch"] / times["before"], 3),
                    "bit_identical": True,
                }
            )
        )


if __name__ == "__main__":
    main()
