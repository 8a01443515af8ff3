"""Where the daemon's RSS settles after load, and what holds it: the worker's RSS split into anonymous
memory (C heap, torch, caches) and file pages (mmap'd spine and packs), and glibc's arena count, at
start, right after a mixed load (4 concurrent clients, a 1,500-token prompt among them) and after an idle pause.
`--long 16384,32768` loads instead with one long prompt after another (random token ids, on e.g. a synthetic
K3 store) and reports the peak and the residue: after-idle RSS - start RSS - what the caches say they hold.

    python tests/bench/bench_rss_plateau.py --store ~/.cache/deltafind/demo [--env MALLOC_ARENA_MAX=8] [--rounds 3]
    python tests/bench/bench_rss_plateau.py --store /tmp/k3wide --make-k3 --long 16384,32768

`--make-k3` first writes a synthetic K3 store there: the tiny shape with K3's real per-head attention and
KDA state sizes (4 heads, hidden 512), so prompt state and activations have real proportions but a 48k-token
load runs in minutes on 2 cores. `--env` starts the daemon with extra environment (one variant per flag, plus the default); one JSON line each.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.bench.bench_grammar_bounds import status_kib, worker_pid
from tests.e2e.daemon_fixtures import Daemon


def memory(pid: int) -> dict:
    """RSS, anonymous and file-backed MiB (smaps_rollup) and the number of glibc arena heaps (64 MiB maps)."""
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        fields[key] = int(value.split()[0])
    heaps = 0
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        parts = line.split()
        lo = int(parts[0].split("-")[0], 16)
        # a thread arena's heap: an anonymous 64 MiB reservation at a 64 MiB boundary (its used part rw, the rest ---)
        if len(parts) == 5 and lo % (64 << 20) == 0 and parts[1] == "rw-p":
            heaps += 1
    return {
        "rss_mib": round(fields["Rss"] / 1024, 1),
        "anon_mib": round(fields["Anonymous"] / 1024, 1),
        "file_mib": round((fields["Rss"] - fields["Anonymous"]) / 1024, 1),
        "arena_heaps": heaps,
    }


def load(d: Daemon, rounds: int) -> None:
    long_prompt = " ".join(f"word{i}" for i in range(700))  # ~1,500 tokens on the demo's tokenizer
    bodies = [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Tell me about Paris."}], "max_tokens": 32},
        ),
        ("/v1/completions", {"prompt": long_prompt, "max_tokens": 4}),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "A city?"}],
                "max_tokens": 24,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "c",
                        "schema": {"type": "object", "properties": {"city": {"type": "string"}}},
                    },
                },
            },
        ),
        ("/v1/messages", {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 24}),
    ]

    def client(k: int) -> None:
        for r in range(rounds):
            path, body = bodies[(k + r) % len(bodies)]
            status, _ = d.post_json(path, {"model": "test-model", **body}, timeout=600)
            assert status == 200, status

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def make_k3_store(dest: Path) -> None:
    from deltafind.importer.setup import setup_store
    from deltafind.importer.synthetic import FAMILIES, open_synthetic
    from deltafind.models import kimi_k3

    shapes = FAMILIES["kimi_k3"].shapes  # this process only: a bench shape beside the family's own
    shapes.setdefault(
        "rss-wide",
        {
            **shapes["tiny"],
            "hidden": 512,
            "heads": 4,
            "q_lora": 256,
            "kv_lora": 512,
            "nope": 128,
            "rope": 64,
            "v": 128,
            "kda_heads": 4,
            "kda_dim": 128,
        },
    )
    setup_store(
        open_synthetic("kimi_k3", "rss-wide"),
        dest,
        [dest / "drive0"],
        progress=False,
        names=kimi_k3.WEIGHTS,
    )


def long_prompts(d: Daemon, lengths: list[int], vocab: int, side: bool) -> int:
    """One prompt after another of random token ids below `vocab` (no text: a synthetic store's vocabulary is
    small). With `side`, a second client meanwhile sends short repetitive prompts (an agent's side requests),
    which the n-gram draft verifies in steps beside the long prefill chunks. Returns the side requests sent."""
    rng, done, sent = random.Random(0), threading.Event(), [0]

    def side_client() -> None:
        while not done.is_set():
            status, body = d.post_json(
                "/v1/completions",
                {"model": "test-model", "max_tokens": 24, "prompt": [11, 12, 13, 14, 15, 16] * 8},
                timeout=1800,
            )
            assert status == 200, (status, body)
            sent[0] += 1

    t = threading.Thread(target=side_client)
    if side:
        t.start()
    try:
        for n in lengths:
            status, body = d.post_json(
                "/v1/completions",
                {
                    "model": "test-model",
                    "max_tokens": 4,
                    "prompt": [rng.randrange(vocab) for _ in range(n)],
                },
                timeout=1800,
            )
            assert status == 200, (status, body)
    finally:
        done.set()
        if side:
            t.join()
    return sent[0]


def holds(d: Daemon) -> dict:
    """What the engine says its caches hold, MiB: the prompt-state (prefix) cache and the expert cache."""
    snap = json.loads(d.ctl("status", "--json").stdout)["snapshot"]
    return {
        "prefix_cache_mib": round(snap["engine"].get("prefix_bytes", 0) / 2**20, 1),
        "expert_cache_mib": round(snap["store"].get("cache_used_bytes", 0) / 2**20, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--env", action="append", default=[], help="KEY=VALUE for one more variant")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--idle-s", type=float, default=5)
    ap.add_argument(
        "--long", default="", help="comma-separated prompt lengths: the long-prompt load instead"
    )
    ap.add_argument(
        "--vocab", type=int, default=480, help="token ids for --long are drawn below this"
    )
    ap.add_argument(
        "--side",
        action="store_true",
        help="with --long: short drafted requests run beside the long ones",
    )
    ap.add_argument(
        "--make-k3",
        action="store_true",
        help="write the widened synthetic K3 store at --store first",
    )
    ap.add_argument("--config", default="", help="TOML appended to the daemon's config")
    args = ap.parse_args()
    if args.make_k3:
        make_k3_store(Path(args.store).expanduser())
    for variant in [None, *args.env]:
        env = dict([variant.split("=", 1)]) if variant else {}
        d = Daemon(Path(args.store).expanduser(), args.config, env=env).start()
        try:
            pid = worker_pid(d)
            start, held0 = memory(pid), holds(d)
            t0 = time.perf_counter()
            side = 0
            if args.long:
                side = long_prompts(
                    d, [int(n) for n in args.long.split(",")], args.vocab, args.side
                )
            else:
                load(d, args.rounds)
            seconds = time.perf_counter() - t0
            after = memory(pid)
            time.sleep(args.idle_s)
            idle, held = memory(pid), holds(d)
            grown = sum(held.values()) - sum(held0.values())  # the caches' growth since start
            print(
                json.dumps(
                    {
                        "env": variant or "default",
                        "load": args.long or f"mixed x{args.rounds}",
                        "side_requests": side,
                        "load_s": round(seconds, 1),
                        "start": start,
                        "after_load": after,
                        "after_idle": idle,
                        "peak_rss_mib": round(status_kib(pid, "VmHWM") / 1024, 1),
                        "engine_holds_at_start": held0,
                        "engine_holds": held,
                        "plateau_mib": round(idle["rss_mib"] - start["rss_mib"], 1),
                        "residue_mib": round(idle["rss_mib"] - start["rss_mib"] - grown, 1),
                    }
                ),
                flush=True,
            )
        finally:
            d.stop()
            d.cleanup()


if __name__ == "__main__":
    main()
