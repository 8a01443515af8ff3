"""Where one demo decode token's CPU time goes: the stored-format kernel calls vs everything else.

Not run in CI. One thread, greedy, the experts it routes to resident (`--read-all`: every expert,
so no prefetch hint is computed); CPU time of the calling thread, so other
tenants of a shared machine barely move it. Decode per token = (t[n tokens] - t[1 token]) / (n - 1),
as bench_demo_vs_llamacpp.py computes it; the kernel share is the time inside the kernel library's
ctypes entry points (`KERNEL_ENTRIES`: the decode chain, the attention step, the gated MLP, the
matmul), one call each. Prints ONE JSON line. To compare with an older tree, run this file with
PYTHONPATH pointing at that tree (`git archive REV deltafind | tar -x -C DIR`): its kernel
figures are null when it has no kernel library.

    python tests/bench/bench_demo_token_profile.py [--store DEMO] [--new-tokens 32] [--rounds 5] [--read-all]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time
from pathlib import Path

# The library's entry points a demo decode token reaches (an older tree lacks the newer ones): the
# layer chain, the attention step, the gated MLP, a token's routed experts and its router, and the
# head's (and any per-matrix) matmul.
KERNEL_ENTRIES = (
    "df_decode_layers",
    "df_attn_decode",
    "df_gated_mlp",
    "df_moe_token",
    "df_route_token",
    "df_stored_parts",
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    home = os.environ.get("DELTAFIND_HOME")
    ap.add_argument(
        "--store",
        type=Path,
        default=(Path(home) if home else Path.home() / ".cache" / "deltafind") / "demo",
    )
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--math", default="exact", help="[device] math: exact, bf16 or q8")
    ap.add_argument(
        "--read-all",
        action="store_true",
        help="read every expert first: the cache holds the whole store (the model fits), so no "
        "prefetch hint can start a read and none is computed",
    )
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    from deltafind import Model
    from deltafind.models.ops.cpu_kernels import CPU

    spent: collections.Counter[str] = collections.Counter()
    lib = CPU.load()
    entries = [n for n in KERNEL_ENTRIES if lib is not None and hasattr(lib, n)]

    def timer(inner):
        def timed(*a):
            t = time.thread_time()
            try:
                return inner(*a)
            finally:
                spent["kernel_s"] += time.thread_time() - t
                spent["calls"] += 1

        return timed

    for name in entries:  # every ctypes entry a decode token calls, timed where the model calls it
        setattr(lib, name, timer(getattr(lib, name)))
    model = Model.open(str(args.store), device="cpu", expert_bytes=None, math=args.math)
    ids = list(model.tokenizer.encode("The capital of France is"))
    model.generate(
        ids, max_new_tokens=8, temperature=0.0
    )  # warm: the experts these tokens route to
    for layer in range(model.net.num_layers) if args.read_all else ():
        for _ in model.experts.fetch(layer, range(model.experts.num_experts(layer))):
            pass

    def run(n: int) -> tuple[float, float, int, int]:
        spent.clear()
        t = time.thread_time()
        out = model.generate(ids, max_new_tokens=n, temperature=0.0)
        return time.thread_time() - t, spent["kernel_s"], spent["calls"], len(out)

    rows = []
    for _ in range(args.rounds):
        c1, k1, n1, _ = run(1)
        cn, kn, nn, n_out = run(args.new_tokens)
        d = n_out - 1
        rows.append(((cn - c1) / d * 1e3, (kn - k1) / d * 1e3, (nn - n1) / d))
    total, kernel, calls = (statistics.median(r[i] for r in rows) for i in range(3))
    has = bool(entries)
    print(
        json.dumps(
            {
                "bench": "demo_token_profile",
                "threads": 1,
                "rounds": args.rounds,
                "new_tokens": args.new_tokens,
                "read_all": args.read_all,
                "decode_cpu_ms_per_token": round(total, 2),
                "kernel_cpu_ms_per_token": round(kernel, 2) if has else None,
                "kernel_calls_per_token": round(calls, 1) if has else None,
                "rest_cpu_ms_per_token": round(total - kernel, 2) if has else None,
                "samples_ms": [[round(v, 2) for v in r] for r in rows],
                "loadavg": [round(v, 2) for v in os.getloadavg()],
            },
            separators=(",", ":"),
        )
    )


if __name__ == "__main__":
    main()
