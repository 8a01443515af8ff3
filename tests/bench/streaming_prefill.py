"""Prefill reads: bytes per prompt token against E(1-(1-k/E)^T)S per layer per chunk,
and a 512-token prompt on a synthetic K3-shaped store projected to 4 drives of 7 GB/s.

The store is `deltafind setup --synthetic kimi_k3 --shape bench` (real-size MXFP4 experts,
reduced width, depth and expert count), made on first use under --root. A cold expert cache
(budget 0) makes every chunk read what it needs; the chunk is the memory-derived one, or
`--chunk`-capped (256 was the daemon's fixed step before). Compute is the longest prompt with
every expert held (read before the clock starts, after a 64-token warm-up of other ids),
timed in wall and CPU seconds (`time.process_time`, all threads: what other load moves least),
once per `[device] math` mode in its own process, the modes alternating which runs first.
Reached through `bench_streaming.py --prefill`.

    python tests/bench/bench_streaming.py --prefill --root /tmp/dfbench
    python tests/bench/streaming_prefill.py /tmp/dfbench --threads 1 --rounds 2   # this bench alone
    python tests/bench/streaming_prefill.py /tmp/dfbench --compute-only --math exact,bf16
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

DRIVES_GB_S = 4 * 7.0  # four drives of 7 GB/s
ARGODRIVE_512_S = 6.3 * 60  # ARGODRIVE's 512-token prefill
K3 = {
    "layers": 92,
    "experts": 896,
    "top_k": 16,
}  # the real model's MoE layers (spec: 93 layers, layer 0 dense)


def k3_store(root: Path) -> Path:
    store = root / "k3"
    if not (store / "manifest.json").exists():
        subprocess.run(
            [
                sys.executable,
                "-m",
                "deltafind.cli",
                "setup",
                "--synthetic",
                "kimi_k3",
                "--shape",
                "bench",
                "--store",
                str(store),
                "--drive",
                str(root / "k3-d0"),
                "--quiet",
            ],
            check=True,
        )
    return store


def expected_bytes(
    T: int, chunk: int, layers: dict[int, tuple[int, int, int]], top_k: int
) -> float:
    """Sum over chunks and layers of E(1-(1-k/E)^Tc)S; a dense layer's slices are all read once a chunk."""
    total = 0.0
    for start in range(0, T, chunk):
        tc = min(chunk, T - start)
        for n, nbytes, routed in layers.values():
            total += (n * (1 - (1 - top_k / n) ** tc) if routed else n) * nbytes
    return total


def one(cfg: dict[str, Any]) -> dict[str, Any]:
    __import__("deltafind")
    import torch

    from deltafind import Model

    torch.set_num_threads(cfg.get("threads", 2))
    store = Path(cfg["store"])
    model = Model.open(store, expert_bytes=0, heat_decay=1.0, max_prefill_tokens=cfg.get("chunk"))
    args, vocab = model.net.args, model.net.args.vocab_size
    top_k, num_experts = args.num_experts_per_token, args.num_experts
    layers = _layers(store, num_experts)
    rows = []
    for T in cfg["lengths"]:
        prompt = [(37 * i + 11) % (vocab - 300) + 1 for i in range(T)]
        chunk = (
            model.prefill.tokens(0)
            if cfg.get("chunk") is None
            else min(cfg["chunk"], model.prefill.tokens(0))
        )
        b0, w0 = model.experts.reader.bytes_read, model.experts.stats.wait_s
        model.generate(prompt, max_new_tokens=1)
        got, want = (
            model.experts.reader.bytes_read - b0,
            expected_bytes(T, min(chunk, T), layers, top_k),
        )
        rows.append(
            {
                "prompt_tokens": T,
                "chunk": min(chunk, T),
                "chunks": math.ceil(T / chunk),
                "bytes_per_token": int(got / T),
                "formula_bytes_per_token": int(want / T),
                "ratio": round(got / want, 4),
                "prefill_s": round(model.last_stats.prefill_s, 3),
                "io_wait_s": round(model.experts.stats.wait_s - w0, 3),
            }
        )
    model.experts.uses.clear()
    model.close()
    return {
        "rows": rows,
        "layers": {lay: list(v) for lay, v in layers.items()},
        "top_k": top_k,
        "experts": num_experts,
    }


def _layers(store: Path, num_experts: int) -> dict[int, tuple[int, int, bool]]:
    """Layer -> (records, mean record bytes, routed) from the store's manifest."""
    from deltafind.store.manifest import Manifest

    per_layer: dict[int, list[int]] = {}
    for r in Manifest.load(store).experts:
        per_layer.setdefault(r.layer, []).append(r.length)
    return {lay: (len(v), sum(v) // len(v), len(v) == num_experts) for lay, v in per_layer.items()}


def compute(cfg: dict[str, Any]) -> dict[str, Any]:
    """One prompt with every expert held, in `[device] math` mode cfg["math"]: wall and CPU seconds."""
    __import__("deltafind")
    import torch

    from deltafind import Model

    torch.set_num_threads(cfg.get("threads", 2))
    model = Model.open(
        Path(cfg["store"]),
        expert_bytes=None,
        heat_decay=1.0,
        max_prefill_tokens=cfg.get("chunk"),
        prefetch=False,
        math=cfg["math"],
    )
    vocab, T = model.net.args.vocab_size, cfg["tokens"]
    prompt = [(37 * i + 11) % (vocab - 300) + 1 for i in range(T)]
    # 64 tokens of other ids warm the kernels and buffers; then every routed expert is read
    model.generate([(41 * i + 7) % (vocab - 300) + 1 for i in range(64)], max_new_tokens=1)
    layers = _layers(Path(cfg["store"]), model.net.args.num_experts)
    for lay, (n, _, routed) in layers.items():
        if routed:
            list(model.experts.fetch(lay, range(n)))
    b0, t0, c0 = model.experts.reader.bytes_read, time.perf_counter(), time.process_time()
    model.generate(prompt, max_new_tokens=1)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    out = {
        "math": cfg["math"],
        "layers": layers,
        "compute_s": wall,
        "compute_cpu_s": cpu,
        "compute_bytes_read": model.experts.reader.bytes_read - b0,
    }
    model.experts.uses.clear()
    model.close()
    return out


def run(cfg: dict[str, Any], env: dict[str, str]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, __file__, "--one", json.dumps(cfg)],
        capture_output=True,
        text=True,
        check=False,
        env=dict(env),
    )
    if proc.returncode:
        raise SystemExit(proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compute_rounds(
    store: Path, env: dict[str, str], threads: int, tokens: int, modes: tuple[str, ...], rounds: int
) -> dict[str, list[dict[str, Any]]]:
    """Each mode once a round in a fresh process, the order reversed every other round."""
    out: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for r in range(rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            cfg = {"store": str(store), "tokens": tokens, "threads": threads, "math": mode}
            got = run({**cfg, "compute": True}, env)
            out[mode].append({**got, "loadavg": [round(x, 2) for x in os.getloadavg()]})
            print(
                json.dumps({"bench": "prefill_compute_round", "round": r, **got}), file=sys.stderr
            )
    return out


def bench(
    root: Path,
    env: dict[str, str],
    threads: int,
    lengths: tuple[int, ...] = (1, 8, 64, 512),
    before_chunk: int = 256,
    modes: tuple[str, ...] = ("exact", "bf16"),
    rounds: int = 2,
    bytes_rows: bool = True,
) -> list[dict[str, Any]]:
    """Bytes per prompt token for each length (memory-derived chunk, and `before_chunk` for the
    longest), the longest prompt's compute per math mode, and the projections."""
    store = k3_store(root)
    T = max(lengths)
    lines: list[dict[str, Any]] = []
    if bytes_rows:
        after = run({"store": str(store), "lengths": list(lengths), "threads": threads}, env)
        before = run(
            {"store": str(store), "lengths": [T], "threads": threads, "chunk": before_chunk}, env
        )
        load = [round(x, 2) for x in os.getloadavg()]
        lines += [
            {"bench": "prefill_bytes", "policy": "memory-derived chunk", **r, "loadavg": load}
            for r in after["rows"]
        ]
        lines += [
            {
                "bench": "prefill_bytes",
                "policy": f"chunk {before_chunk} (the daemon's fixed step before)",
                **r,
                "loadavg": load,
            }
            for r in before["rows"]
        ]
        longest = after["rows"][-1]
        bytes_read = longest["bytes_per_token"] * T
        lines.append(
            {
                "bench": "prefill_512_projected",
                "store": "synthetic kimi_k3 bench",
                "prompt_tokens": T,
                "bytes_read": bytes_read,
                "read_s_at_28_gb_s": round(bytes_read / (DRIVES_GB_S * 1e9), 3),
                "measured_cold_s_this_vm": longest["prefill_s"],
                "before_chunk_bytes_read": before["rows"][0]["bytes_per_token"] * T,
                "loadavg": load,
            }
        )
    runs = compute_rounds(store, env, threads, T, modes, rounds)
    layers = runs[modes[0]][0]["layers"]
    # The real K3: 92 MoE layers of 896 experts (same record size as the bench store's), one chunk
    # for 512 tokens; compute scales by MoE layers (the bench store's other work rides along).
    size = next(v[1] for v in layers.values() if v[2])
    moe_layers = sum(1 for v in layers.values() if v[2])
    k3_bytes = K3["layers"] * K3["experts"] * (1 - (1 - K3["top_k"] / K3["experts"]) ** T) * size
    k3_read_s = k3_bytes / (DRIVES_GB_S * 1e9)
    line: dict[str, Any] = {
        "bench": "prefill_512_k3_projected",
        "prompt_tokens": T,
        "threads": threads,
        "expert_record_bytes": size,
        "bytes_read": int(k3_bytes),
        "read_s_at_28_gb_s": round(k3_read_s, 1),
    }
    for mode, rs in runs.items():
        wall = statistics.median(r["compute_s"] for r in rs)
        cpu = statistics.median(r["compute_cpu_s"] for r in rs)
        line[mode] = {
            "bench_store_wall_s": [round(r["compute_s"], 2) for r in rs],
            "bench_store_cpu_s": [round(r["compute_cpu_s"], 2) for r in rs],
            "bytes_read_while_timed": max(r["compute_bytes_read"] for r in rs),
            "loadavg": [r["loadavg"] for r in rs],
            "projected_compute_s": round(wall / moe_layers * K3["layers"], 1),
            "projected_compute_cpu_s": round(cpu / moe_layers * K3["layers"], 1),
            "projected_s": round(k3_read_s + wall / moe_layers * K3["layers"], 1),
        }
    if "exact" in runs and "bf16" in runs:
        line["bf16_cpu_s_over_exact"] = round(
            line["bf16"]["projected_compute_cpu_s"] / line["exact"]["projected_compute_cpu_s"], 3
        )
    line["argodrive_s"] = ARGODRIVE_512_S
    line["note"] = (
        "compute: the bench store's prefill (width 1024, every expert held), median of the rounds, "
        "per MoE layer x 92 on this machine; attention at K3's real width is not in it"
    )
    return [*lines, line]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path, nargs="?", default=Path("/tmp/dfbench"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=512, help="the projected prompt's length")
    ap.add_argument("--math", default="exact,bf16", help="[device] math modes, comma-separated")
    ap.add_argument("--rounds", type=int, default=2, help="compute runs per mode, alternated")
    ap.add_argument("--compute-only", action="store_true", help="skip the cold bytes rows")
    a = ap.parse_args()
    modes = tuple(a.math.split(","))
    if bad := [m for m in modes if m not in ("exact", "bf16")]:
        ap.error(f"--math: {bad} is not exact or bf16")
    a.root.mkdir(parents=True, exist_ok=True)
    lengths = (*(t for t in (1, 8, 64) if t < a.tokens), a.tokens)
    for line in bench(
        a.root, dict(os.environ), a.threads, lengths, 256, modes, a.rounds, not a.compute_only
    ):
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        cfg = json.loads(sys.argv[2])
        print(json.dumps(compute(cfg) if cfg.get("compute") else one(cfg)))
    else:
        main()
