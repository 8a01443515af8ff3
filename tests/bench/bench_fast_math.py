"""The opt-in bf16 prefill matmuls (`[device] math = "bf16"`, NOT bit-exact) against the exact path.

Not run in CI. One JSON line per point, in three parts:
- kernel: GFLOP/s of one matmul at --rows, exact (today's kernels) vs bf16 (fast_cpu.cpp) vs torch's
  bf16 matmul (oneDNN on AVX512-BF16) after a per-call exact decode rounded to bf16, on Q4_K 3072 x
  3584, K3's MXFP4 expert w1 (3072 x 3584) and w2 (3584 x 3072), and bf16 3072 x 3584. One thread,
  timed by its CPU time, median of --rounds rounds, the three alternating.
- prefill: tok/s of one prefill of --tokens tokens (bench_prefill.py's prompt), exact and bf16
  alternating which runs first; a fresh model per timing, warmed by a prefill of the same ids reversed,
  so the experts are read and kept before the clock starts and no prompt state is reused.
- drift: teacher-forced logits over --drift-tokens positions, bf16 against exact: max |dlogit|,
  mean |dlogit| over the logits' std, top-1 agreement (as bench_int8_spine.py for the int8 spine).

    python tests/bench/bench_fast_math.py --k3-root /tmp/dffast [--demo-store DIR] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_int8_spine import k3_store
from bench_prefill import demo_store, prompt_text

from deltafind.models.ops import fast_math, mxfp4
from deltafind.models.ops.stored import stored_linear
from deltafind.models.ops.stored_weight import StoredWeight, dequantize
from tests.conftest import gguf_blocks

SHAPES = {
    "q4_k": (3072, 3584),
    "mxfp4_w1": (3072, 3584),
    "mxfp4_w2": (3584, 3072),
    "bf16": (3072, 3584),
}


def _matmuls(name: str) -> tuple:
    """(stored-format matmul of x, the weights decoded exactly to fp32) for one SHAPES entry."""
    R, C = SHAPES[name]
    g = torch.Generator().manual_seed(0)
    if name.startswith("mxfp4"):
        p = torch.randint(0, 256, (R, C // 2), dtype=torch.uint8, generator=g)
        s = torch.randint(118, 127, (R, C // 32), dtype=torch.uint8, generator=g)
        return (lambda x: mxfp4.mxfp4_linear(x, p, s)), (lambda: mxfp4.dequantize(p, s))
    w = (
        StoredWeight.of((torch.randn(R, C, generator=g) * 0.05).bfloat16())
        if name == "bf16"
        else StoredWeight.of(gguf_blocks("Q4_K", R, C), "Q4_K", C)
    )
    return (lambda x: stored_linear(x, w)), (lambda: dequantize(w))


def kernels(rows: list[int], rounds: int) -> None:
    torch.set_num_threads(1)
    for name, (R, C) in SHAPES.items():
        matmul, decode = _matmuls(name)
        for T in rows:
            x = torch.randn(T, C, generator=torch.Generator().manual_seed(T))

            def torch_bf16(x: torch.Tensor = x, decode=decode) -> torch.Tensor:
                return torch.nn.functional.linear(x.bfloat16(), decode().bfloat16()).float()

            ways = {
                "exact": ("exact", matmul),
                "bf16": ("bf16", matmul),
                "torch_bf16": ("exact", torch_bf16),
            }
            times: dict[str, list[float]] = {w: [] for w in ways}
            for r in range(rounds + 1):  # round 0 warms (pages, the kernel build)
                for way in ways if r % 2 else reversed(list(ways)):
                    mode, f = ways[way]
                    fast_math.use(mode)
                    t0 = time.thread_time()
                    f(x)
                    if r:
                        times[way].append(time.thread_time() - t0)
            fast_math.use("exact")
            line = {"bench": "fast_math_kernel", "matrix": name, "rows": T, "shape": [R, C]}
            for way, ts in times.items():
                line[f"{way}_gflops"] = round(2.0 * T * R * C / statistics.median(ts) / 1e9, 1)
            line["bf16_over_exact"] = round(line["bf16_gflops"] / line["exact_gflops"], 2)
            print(json.dumps(line), flush=True)


def _open(store: Path, mode: str):
    from deltafind import Model

    return Model.open(str(store), device="cpu", expert_bytes=None, math=mode)


def prefill(store: Path, tokens: int, rounds: int, threads: int) -> None:
    from deltafind.engine.sampler import SamplingParams

    torch.set_num_threads(threads)
    times: dict[str, list[float]] = {"exact": [], "bf16": []}
    for r in range(rounds):
        for mode in ("exact", "bf16") if r % 2 == 0 else ("bf16", "exact"):
            model = _open(store, mode)
            try:
                ids = list(model.tokenizer.encode(prompt_text(tokens)))[:tokens]
                params = SamplingParams(max_new_tokens=1, ignore_eos=True)
                list(model.stream(ids[::-1], params))  # experts read and kept; no shared prefix
                t0 = time.perf_counter()
                list(model.stream(ids, params))
                times[mode].append(time.perf_counter() - t0)
            finally:
                model.close()
    line = {"bench": "fast_math_prefill", "store": str(store), "tokens": tokens, "threads": threads}
    for mode, ts in times.items():
        line[f"{mode}_tok_s"] = round(tokens / statistics.median(ts), 1)
        line[f"{mode}_rounds_s"] = [round(t, 2) for t in ts]
    line["bf16_over_exact"] = round(line["bf16_tok_s"] / line["exact_tok_s"], 2)
    line["loadavg"] = [round(v, 2) for v in os.getloadavg()]
    print(json.dumps(line), flush=True)


def drift_stats(exact: torch.Tensor, other: torch.Tensor) -> dict:
    """How far a mode's teacher-forced logits [T, V] lie from exact's (bench_moe_vs_llamacpp.py's q8 too)."""
    delta = (exact - other).abs()
    return {
        "positions": exact.shape[0],
        "max_abs_dlogit": round(float(delta.max()), 4),
        "mean_abs_dlogit_over_logit_std": round(float(delta.mean() / exact.std()), 5),
        "top1_agreement": round(float((exact.argmax(-1) == other.argmax(-1)).float().mean()), 4),
    }


def drift(store: Path, tokens: int, threads: int) -> None:
    torch.set_num_threads(threads)
    logits = {}
    for mode in ("exact", "bf16"):
        model = _open(store, mode)
        try:
            ids = list(model.tokenizer.encode(prompt_text(tokens)))[:tokens]
            logits[mode] = model.forward_logits(ids)
        finally:
            model.close()
    stats = drift_stats(logits["exact"], logits["bf16"])
    print(json.dumps({"bench": "fast_math_drift", "store": str(store), **stats}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--k3-root", type=Path, required=True, help="where the synthetic K3 store is built"
    )
    ap.add_argument("--demo-store", type=Path, default=demo_store())
    ap.add_argument("--rows", default="1,8,16,64,256,512")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prefill-rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--k3-tokens", type=int, default=512)
    ap.add_argument("--drift-tokens", type=int, default=300)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--parts", default="kernel,prefill,drift")
    a = ap.parse_args()
    if not fast_math.available():
        sys.exit(fast_math.unavailable_note())
    parts = set(a.parts.split(","))
    if "kernel" in parts:
        kernels([int(r) for r in a.rows.split(",")], a.rounds)
    stores = [(a.demo_store, a.tokens)] if (a.demo_store / "manifest.json").exists() else []
    stores.append((k3_store(a.k3_root), a.k3_tokens))
    for store, tokens in stores:
        if "prefill" in parts:
            prefill(store, tokens, a.prefill_rounds, a.threads)
        if "drift" in parts:
            drift(store, a.drift_tokens, a.threads)


if __name__ == "__main__":
    main()
