"""One decode token's MoE routers alone: `layers` Qwen3-30B-A3B-shaped routers (128 experts, top-8,
hidden 2048, renormalised, random fp32 weights), each called on one token as a decode token calls it.

Not run in CI. Cold (the default): before each token `--evict-mb` of other memory is written, as a
decode token's head (~255 MB on the bench model) pushes the routers' weights out of the caches; warm:
the weights stay cached. Times `router(x)` of the tree on PYTHONPATH (run it again with PYTHONPATH at
an older checkout to compare) and, in the same process, torch's ops for the same route (F.linear,
softmax, topk, the renormalisation). Medians over `--rounds` tokens, microseconds per layer; prints
ONE JSON line.

`--store DIR` instead times each `df_route_token` call inside a real 2-thread greedy decode of that
store (q8, every expert read first), the call's thread count alternating 2 / 1 call by call: whether
splitting the rows on the pool pays, under the same load in one process.

    python tests/bench/bench_router.py [--threads 1,2] [--layers 8] [--rounds 41] [--evict-mb 256]
    python tests/bench/bench_router.py --store /tmp/dfmoe/store-8l [--rounds 3]
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
    ap.add_argument("--store", help="time the router calls of a real decode of this store instead")
    args = ap.parse_args()
    if args.store:
        return in_decode(args.store, args.rounds)

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


def in_decode(store: str, rounds: int) -> None:
    import torch

    from deltafind import Model
    from deltafind.models.ops.cpu_kernels import CPU

    torch.set_num_threads(2)
    lib = CPU.load()
    call, times, calls = lib.df_route_token, {1: [], 2: []}, [0]

    def alternating(*a: object) -> int:
        threads = 2 - calls[0] % 2
        calls[0] += 1
        t = time.perf_counter()
        rc = call(*a[:-1], threads)
        times[threads].append(time.perf_counter() - t)
        return rc

    model = Model.open(store, device="cpu", expert_bytes=None, math="q8")
    ids = list(model.tokenizer.encode("The capital of France is"))
    model.generate(ids, max_new_tokens=4, temperature=0.0)
    for layer in range(model.net.num_layers):
        for _ in model.experts.fetch(layer, range(model.experts.num_experts(layer))):
            pass
    lib.df_route_token = alternating
    for _ in range(rounds):
        model.generate(ids, max_new_tokens=33, temperature=0.0)
    us = {t: sorted(v * 1e6 for v in ts) for t, ts in times.items()}
    print(
        json.dumps(
            {
                "bench": "router_in_decode",
                "store": store,
                "per_call_us": {
                    t: {
                        "calls": len(v),
                        "median": round(statistics.median(v), 1),
                        "mean": round(statistics.fmean(v), 1),
                        "p10": round(v[len(v) // 10], 1),
                        "p90": round(v[len(v) * 9 // 10], 1),
                    }
                    for t, v in us.items()
                },
                "loadavg": [round(v, 2) for v in os.getloadavg()],
            },
            separators=(",", ":"),
        )
    )


if __name__ == "__main__":
    main()
