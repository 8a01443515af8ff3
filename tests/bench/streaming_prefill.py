"""Prefill reads: bytes per prompt token against E(1-(1-k/E)^T)S per layer per chunk,
and a 512-token prompt on a synthetic K3-shaped store projected to 4 drives of 7 GB/s.

The store is `deltafind setup --synthetic kimi_k3 --shape bench` (real-size MXFP4 experts,
reduced width, depth and expert count), made on first use under --root. A cold expert cache
(budget 0) makes every chunk read what it needs; the chunk is the memory-derived one, or
`--chunk`-capped (256 was the daemon's fixed step before). Compute is the same prompt again
with every expert held (no reads). Reached through `bench_streaming.py --prefill`.

    python tests/bench/bench_streaming.py --prefill --root /tmp/dfbench
    python tests/bench/streaming_prefill.py /tmp/dfbench   # this bench alone
"""

from __future__ import annotations

import json
import math
import os
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
    from deltafind.store.manifest import Manifest

    torch.set_num_threads(cfg.get("threads", 2))
    store = Path(cfg["store"])
    manifest = Manifest.load(store)
    model = Model.open(store, expert_bytes=0, heat_decay=1.0, max_prefill_tokens=cfg.get("chunk"))
    args, vocab = model.net.args, model.net.args.vocab_size
    top_k, num_experts = args.num_experts_per_token, args.num_experts
    per_layer: dict[int, list[int]] = {}
    for r in manifest.experts:
        per_layer.setdefault(r.layer, []).append(r.length)
    layers = {
        lay: (len(v), sum(v) // len(v), len(v) == num_experts) for lay, v in per_layer.items()
    }
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
    out: dict[str, Any] = {
        "rows": rows,
        "layers": {lay: list(v) for lay, v in layers.items()},
        "top_k": top_k,
        "experts": num_experts,
    }
    if cfg.get("compute"):  # the longest prompt again with every expert held: its compute alone
        model = Model.open(
            store,
            expert_bytes=None,
            heat_decay=1.0,
            max_prefill_tokens=cfg.get("chunk"),
            prefetch=False,
        )
        T = max(cfg["lengths"])
        prompt = [(37 * i + 11) % (vocab - 300) + 1 for i in range(T)]
        model.generate(prompt, max_new_tokens=1)  # reads them all
        b0, t0 = model.experts.reader.bytes_read, time.perf_counter()
        model.generate(prompt, max_new_tokens=1)
        out["compute_s"], out["compute_bytes_read"] = (
            time.perf_counter() - t0,
            model.experts.reader.bytes_read - b0,
        )
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


def bench(
    root: Path,
    env: dict[str, str],
    threads: int,
    lengths: tuple[int, ...] = (1, 8, 64, 512),
    before_chunk: int = 256,
) -> list[dict[str, Any]]:
    """Bytes per prompt token for each length (memory-derived chunk, and `before_chunk` for the longest), and the projections."""
    store = k3_store(root)
    after = run(
        {"store": str(store), "lengths": list(lengths), "threads": threads, "compute": True}, env
    )
    before = run(
        {"store": str(store), "lengths": [max(lengths)], "threads": threads, "chunk": before_chunk},
        env,
    )
    load = [round(x, 2) for x in os.getloadavg()]
    lines: list[dict[str, Any]] = [
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
    read_s = longest["bytes_per_token"] * longest["prompt_tokens"] / (DRIVES_GB_S * 1e9)
    lines.append(
        {
            "bench": "prefill_512_projected",
            "store": "synthetic kimi_k3 bench",
            "prompt_tokens": longest["prompt_tokens"],
            "bytes_read": longest["bytes_per_token"] * longest["prompt_tokens"],
            "read_s_at_28_gb_s": round(read_s, 3),
            "compute_s": round(after["compute_s"], 3),
            "projected_s": round(read_s + after["compute_s"], 3),
            "measured_cold_s_this_vm": longest["prefill_s"],
            "before_chunk_bytes_read": before["rows"][0]["bytes_per_token"]
            * longest["prompt_tokens"],
            "loadavg": load,
        }
    )
    # The real K3: 92 MoE layers of 896 experts (same record size as the bench store's), one chunk for 512 tokens.
    size = next(v[1] for v in after["layers"].values() if v[2])
    T, moe_layers = longest["prompt_tokens"], sum(1 for v in after["layers"].values() if v[2])
    k3_bytes = K3["layers"] * K3["experts"] * (1 - (1 - K3["top_k"] / K3["experts"]) ** T) * size
    k3_compute = after["compute_s"] / moe_layers * K3["layers"]
    lines.append(
        {
            "bench": "prefill_512_k3_projected",
            "prompt_tokens": T,
            "expert_record_bytes": size,
            "bytes_read": int(k3_bytes),
            "read_s_at_28_gb_s": round(k3_bytes / (DRIVES_GB_S * 1e9), 1),
            "compute_s_scaled_by_moe_layers_this_vm": round(k3_compute, 1),
            "projected_s": round(k3_bytes / (DRIVES_GB_S * 1e9) + k3_compute, 1),
            "argodrive_s": ARGODRIVE_512_S,
            "note": "compute: the bench store's measured prefill (width 1024) per MoE layer x 92, on this 2-core VM; "
            "attention at K3's real width is not in it",
        }
    )
    return lines


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        print(json.dumps(one(json.loads(sys.argv[2]))))
    else:  # this bench alone: streaming_prefill.py [ROOT]
        root = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/dfbench")
        root.mkdir(parents=True, exist_ok=True)
        for line in bench(root, dict(os.environ), 2):
            print(json.dumps(line), flush=True)
