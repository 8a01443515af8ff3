"""Continuous batching: aggregate decode tok/s for 1, 4 and 8 concurrent streams.

Runs the daemon's Scheduler in-process (no HTTP) on a streaming store with a
zero expert cache, so every step reads its experts from the drives: batching
shares one read per expert across all sequences of a step. Each concurrency
level runs in a fresh subprocess; levels alternate over rounds, medians win.
Prints one JSON line per store and a summary on stderr.

    python tests/bench/bench_concurrency.py [--demo-store DIR] [--moe-store DIR] [--tokens 8] [--rounds 2]

Decode rate: tokens received after every stream has its first token, over the
time from then until the last stream ends (prefill excluded).
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fib(n):",
    "My favourite colour is",
    "1, 2, 3, 4,",
    "The quick brown fox",
    "Water boils at",
    "In 1492, Columbus",
]


def one(cfg: dict) -> dict:
    import torch

    from deltafind import Model
    from deltafind.engine.sampler import SamplingParams
    from deltafind.engine.scheduler import Scheduler, SchedulerLimits
    from deltafind.engine.sequence import FinishEvent, GenRequest

    torch.set_num_threads(cfg["threads"])
    m = Model.open(cfg["store"], expert_bytes=0, prefetch=cfg["prefetch"])
    n, tokens = cfg["streams"], cfg["tokens"]
    sched = Scheduler(m.net, m.eos_token_ids, SchedulerLimits(max_running=8, max_step_tokens=512))
    try:
        prompts = [tuple(m.tokenizer.encode(p) or [1]) for p in PROMPTS[:n]]
        mux: queue.Queue = (
            queue.Queue()
        )  # one queue for all streams: each event is timed as it arrives
        bytes0 = m.experts.stats.bytes_read
        handles = [
            sched.submit(GenRequest(p, SamplingParams(max_new_tokens=tokens, ignore_eos=True)), mux)
            for p in prompts
        ]
        index = {h.seq_id: i for i, h in enumerate(handles)}
        times: list[list[float]] = [[] for _ in handles]
        open_ = len(handles)
        while open_:
            seq_id, event = mux.get()
            if isinstance(event, FinishEvent):
                open_ -= 1
            else:
                times[index[seq_id]].append(time.perf_counter())
        t0 = max(ts[0] for ts in times)
        t1 = max(ts[-1] for ts in times)
        decoded = sum(1 for ts in times for t in ts if t > t0)
        st = sched.stats
        return {
            "streams": n,
            "decode_tok_s": decoded / (t1 - t0) if t1 > t0 else 0.0,
            "steps": st.steps,
            "bytes_read": m.experts.stats.bytes_read - bytes0,
            "max_batch": st.max_batch,
        }
    finally:
        sched.close()
        m.close()


def run(store: Path, streams: int, args: argparse.Namespace) -> dict:
    cfg = {
        "store": str(store),
        "streams": streams,
        "tokens": args.tokens,
        "threads": args.threads,
        "prefetch": args.prefetch,
    }
    proc = subprocess.run(
        [sys.executable, __file__, "--one", json.dumps(cfg)],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if proc.returncode:
        raise SystemExit(proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def bench(name: str, store: Path, args: argparse.Namespace) -> dict:
    levels = [1, 4, 8]
    results: dict[int, list[dict]] = {n: [] for n in levels}
    for r in range(args.rounds):
        for n in levels if r % 2 == 0 else reversed(levels):
            res = run(store, n, args)
            print(
                f"[{name}] round {r} streams {n}: {res['decode_tok_s']:.2f} tok/s, {res['steps']} steps, "
                f"{res['bytes_read'] / 1e6:.0f} MB read",
                file=sys.stderr,
            )
            results[n].append(res)
    tok_s = {n: statistics.median(x["decode_tok_s"] for x in results[n]) for n in levels}
    mb_tok = {
        n: statistics.median(
            x["bytes_read"] / (x["streams"] * args.tokens) / 1e6 for x in results[n]
        )
        for n in levels
    }
    return {
        "bench": "concurrency",
        "store": name,
        "path": str(store),
        "tokens": args.tokens,
        "threads": args.threads,
        "rounds": args.rounds,
        "decode_tok_s": {str(n): round(v, 3) for n, v in tok_s.items()},
        "ratio_to_one": {str(n): round(v / tok_s[1], 2) for n, v in tok_s.items()},
        "mb_read_per_token": {str(n): round(v, 1) for n, v in mb_tok.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--demo-store", type=Path, help="the demo store (default $DELTAFIND_HOME/demo)")
    p.add_argument(
        "--moe-store", type=Path, help="a synthetic qwen3_moe store (bench_streaming.py's q1)"
    )
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prefetch", action="store_true", help="next-layer prefetch on (default off)")
    args = p.parse_args()
    if args.one:
        print(json.dumps(one(json.loads(args.one))))
        return
    from deltafind.run_cli import demo_store_dir

    stores = [("demo", args.demo_store or demo_store_dir())]
    if args.moe_store:
        stores.append(("qwen3_moe", args.moe_store))
    for name, store in stores:
        if not (Path(store) / "manifest.json").exists():
            print(f"skip {name}: no store at {store}", file=sys.stderr)
            continue
        print(json.dumps(bench(name, Path(store), args)))


if __name__ == "__main__":
    main()
