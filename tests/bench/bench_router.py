"""One decode token's MoE routers alone: `layers` Qwen3-30B-A3B-shaped routers (128 experts, top-8,
hidden 2048, renormalised, random fp32 weights), each called on one token as a decode token calls it.

Not run in CI. Cold (the default): before each token `--evict-mb` of other memory is written, as a
decode token's head (~255 MB on the bench model) pushes the routers' weights out of the caches; warm:
the weights stay cached. Times `router(x)` of the tree on PYTHONPATH (run it again with PYTHONPATH at
an older checkout to compare) and, in the same process, torch's ops for the same route (F.linear,
softmax, topk, the renormalisation). Medians over `--rounds` tokens, microseconds per layer; prints
ONE JSON line.

    python tests/bench/bench_router.py [--threads 1,2] [--layers 8] [--rounds 41] [--evict-mb 256]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=41)
    ap.add_argument("--evict-mb", type=int, default=256)
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F

    from deltafind.models.qwen3_moe import ModelArgs, Router

    shape = ModelArgs(
        vocab_size=8,
        hidden_size=2048,
        intermediate_size=8,
        num_hidden_layers=args.layers,
        num_attention_heads=1,
        moe_intermediate_size=8,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
    )
    gen = torch.Generator().manual_seed(0)
    routers = [Router(shape) for _ in range(args.layers)]
    for r in routers:
        with torch.no_grad():
            r.weight.normal_(0, 0.05, generator=gen)
    x = torch.randn(1, 2048, generator=gen)
    junk = torch.zeros(args.evict_mb << 18)  # fp32: 4 bytes each

    def torch_ops(r: Router) -> None:
        w, _ = torch.topk(F.linear(x, r.weight).softmax(-1), r.top_k, dim=-1)
        _ = w / w.sum(dim=-1, keepdim=True)

    def per_layer(call, cold: bool, threads: int) -> float:
        times = []
        for _ in range(args.rounds):
            if (
                cold
            ):  # on one thread: idle OpenMP workers spinning after it took a core from the pool's
                torch.set_num_threads(1)
                junk.add_(1.0)
                torch.set_num_threads(threads)
            t = time.perf_counter()
            for r in routers:
                call(r)
            times.append(time.perf_counter() - t)
        return round(statistics.median(times) / len(routers) * 1e6, 1)

    rows = {}
    with torch.inference_mode():
        for threads in [int(t) for t in args.threads.split(",")]:
            torch.set_num_threads(threads)
            rows[threads] = {
                f"{name}_{state}_us": per_layer(call, state == "cold", threads)
                for state in ("cold", "warm")
                for name, call in (("router", lambda r: r(x)), ("torch_ops", torch_ops))
            }
    print(
        json.dumps(
            {
                "bench": "router",
                "layers": args.layers,
                "rounds": args.rounds,
                "evict_mb": args.evict_mb,
                "kernel": hasattr(Router, "one_token"),
                "per_layer": rows,
                "loadavg": [round(v, 2) for v in os.getloadavg()],
            },
            separators=(",", ":"),
        )
    )


if __name__ == "__main__":
    main()
