"""Chunked prefill beside decode: a running stream's worst inter-token gap while a long prompt arrives.

On the demo store, the daemon's Scheduler in-process (no HTTP) with the limits the daemon builds when
`[server] max_prefill_tokens` is unset: a greedy stream runs, then a PROMPT-token prompt is submitted.
Measured per mode, each in a fresh process: the stream's worst and median gap between tokens while the
prompt prefills (submission to its first token), that prefill's wall time, steps and expert bytes read.
Modes: `chunked` (`[server] step_target_s`, the default 0.5 s) and `one_step` (step_target_s = 0, as
before). `--expert-bytes 0` (the default here) reads every expert on every step, the worst case for
chunking; `--expert-bytes none` holds the demo's dense layers whole and reads nothing after warm-up.
Prints one JSON line.

    python tests/bench/bench_interleave.py [--store DIR] [--prompt 4000] [--threads 1] [--expert-bytes 0|none]
"""

from __future__ import annotations

import argparse
import itertools
import json
import queue
import statistics
import subprocess
import sys
import time
from pathlib import Path

STREAM_PROMPT = "The capital of France is"


def one(cfg: dict) -> dict:
    import torch

    from deltafind import Model
    from deltafind.engine.sampler import SamplingParams
    from deltafind.engine.scheduler import Scheduler, SchedulerLimits
    from deltafind.engine.sequence import FinishEvent, GenRequest

    torch.set_num_threads(cfg["threads"])
    m = Model.open(cfg["store"], expert_bytes=cfg["cache_bytes"])
    context = int(m.net.args.max_position_embeddings)
    limits = SchedulerLimits(
        max_running=8,
        max_queue=8,
        max_step_tokens=context,
        max_context=context,
        prefill=m.prefill,
        step_target_s=cfg["target_s"] or None,
    )  # as daemon/runtime.py builds them
    sched = Scheduler(m.net, m.eos_token_ids, limits)
    try:
        text = " ".join(
            f"item {i} is the {['red', 'blue', 'green'][i % 3]} box on shelf {i % 17}."
            for i in range(2000)
        )
        long = tuple(m.tokenizer.encode(text)[: cfg["prompt"]])
        assert len(long) == cfg["prompt"], "the text is too short for the prompt length asked"
        mux: queue.Queue = queue.Queue()  # both sequences' events, each timed as it arrives
        stream = sched.submit(
            GenRequest(
                tuple(m.tokenizer.encode(STREAM_PROMPT)),
                SamplingParams(max_new_tokens=context, ignore_eos=True),
            ),
            mux,
        )
        stamps: list[float] = []
        while len(stamps) < 3:  # the stream is decoding before the prompt arrives
            stamps.append((mux.get(), time.perf_counter())[1])
        steps0, bytes0 = sched.stats.steps, m.experts.stats.bytes_read
        t0 = time.perf_counter()
        h = sched.submit(GenRequest(long, SamplingParams(max_new_tokens=1)), mux)
        first = None
        while first is None:
            seq_id, event = mux.get()
            now = time.perf_counter()
            if seq_id == stream.seq_id and not isinstance(event, FinishEvent):
                stamps.append(now)
            elif seq_id == h.seq_id:
                first = now
        steps, nbytes = sched.stats.steps - steps0, m.experts.stats.bytes_read - bytes0
        while True:  # the stream's next token closes the gap that spans the prefill's end
            seq_id, event = mux.get()
            if seq_id == stream.seq_id and not isinstance(event, FinishEvent):
                stamps.append(time.perf_counter())
                break
        stream.cancel()
        gaps = [b - a for a, b in itertools.pairwise(stamps) if b > t0]
        return {
            "prefill_s": round(first - t0, 3),
            "prefill_steps": steps,
            "prefill_bytes_read": nbytes,
            "worst_gap_s": round(max(gaps), 3),
            "median_gap_s": round(statistics.median(gaps), 3),
            "stream_tokens_during_prefill": sum(t0 < s <= first for s in stamps),
        }
    finally:
        sched.close()
        m.close()


def run(cfg: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--one", json.dumps(cfg)],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if proc.returncode:
        raise SystemExit(proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", type=Path, default=Path("~/.cache/deltafind/demo").expanduser())
    ap.add_argument("--prompt", type=int, default=4000, help="tokens of the prompt that arrives")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--expert-bytes",
        type=lambda v: None if v.lower() == "none" else int(v),
        default=0,
        help="expert cache bytes (0: every step reads its experts; none: no limit, dense layers held whole)",
    )
    ap.add_argument(
        "--target-s", type=float, default=0.5, help="[server] step_target_s of the chunked mode"
    )
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(json.loads(args.one))))
        return
    base = {
        "store": str(args.store),
        "prompt": args.prompt,
        "threads": args.threads,
        "cache_bytes": args.expert_bytes,
    }
    out = {
        "bench": "interleave",
        "prompt_tokens": args.prompt,
        "threads": args.threads,
        "cache_bytes": args.expert_bytes,
        "step_target_s": args.target_s,
    }
    out["chunked"] = run({**base, "target_s": args.target_s})
    out["one_step"] = run({**base, "target_s": 0})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
