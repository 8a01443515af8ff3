"""Expert-streaming benchmarks (issue 3): efficiency, drive scaling, prefetch value, memory.

Each configuration runs in a fresh subprocess (cold expert cache, its own peak
RSS); configurations alternate so machine noise hits all of them alike.
Stores are seeded synthetic qwen3_moe stores with bf16 experts (9 MiB each),
made on first use under --root. Prints one JSON line per bench and a summary.
`--before DIR` (a checkout of an older deltafind, e.g. `git archive REV | tar -x -C DIR`)
runs every configuration under both trees in the same rounds, side by side.

    python tests/bench/bench_streaming.py --root /tmp/dfbench [--rounds 2] [--tokens 6] [--before DIR]
    python tests/bench/bench_streaming.py --profile /tmp/dfbench/q2 --tokens 8 --no-prefetch   # where a decode spends its time
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ENV = dict(os.environ)  # before deltafind is imported here (it sets OMP_WAIT_POLICY): what --before runs get
SHAPE = {"layers": 2}  # the qwen3_moe "bench" shape, 2 layers: 128 experts x 9 MiB


def make_store(root: Path, drives: int) -> Path:
    import deltafind.store.synthetic_families  # noqa: F401 - registers the families
    from deltafind.store.setup import setup_store
    from deltafind.store.synthetic import FAMILIES, open_synthetic

    store = root / f"q{drives}"
    if not (store / "manifest.json").exists():
        fam = FAMILIES["qwen3_moe"]
        fam.shapes["bench-stream"] = {**fam.shapes["bench"], **SHAPE}
        setup_store(open_synthetic("qwen3_moe", "bench-stream", 0), store, [root / f"q{drives}-drive{i}" for i in range(drives)], progress=False)
    return store


def _rss_now() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def one(cfg: dict) -> dict:
    """Decode `tokens` tokens on a cold cache; report rates (runs in its own process)."""
    __import__("deltafind")  # first: deltafind sets its OpenMP defaults before torch loads
    import torch

    from deltafind import Model
    from deltafind.engine.sampler import SamplingParams
    from deltafind.store.experts import PrefetchOptions
    from deltafind.store.manifest import Manifest
    from deltafind.store.reader import DriveOptions, PackReader

    torch.set_num_threads(cfg.get("threads", 2))
    store = Path(cfg["store"])
    n_drives = len(Manifest.load(store).drives)
    drives = [DriveOptions(queue_depth=cfg.get("queue_depth", 8), read_mb_s=cfg.get("read_mb_s"))] * n_drives
    if cfg.get("raw"):
        manifest = Manifest.load(store)
        reader = PackReader(manifest, store, verify=False, drives=drives)
        t0 = time.perf_counter()
        for fut in [reader.submit(r) for r in manifest.experts]:
            reader.release(fut.result())
        dt = time.perf_counter() - t0
        reader.close()
        return {"raw_gb_s": reader.bytes_read / dt / 1e9}
    runtime_rss = _rss_now()  # torch and deltafind imported, nothing loaded
    model = Model.open(store, expert_cache_bytes=cfg.get("cache", 0), drives=drives,
                       prefetch=PrefetchOptions(enabled=cfg.get("prefetch", True), max_in_flight=16), heat_decay=1.0)
    spine_resident = sum(p.numel() * p.element_size() for p in model.net.parameters()) + sum(b.numel() * b.element_size() for b in model.net.buffers())
    ids = [65, 66, 67, 68]
    params = SamplingParams(max_new_tokens=cfg["tokens"], ignore_eos=True)
    t0, r0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    list(model.stream(ids, params))
    wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    s, e = model.last_stats, model.experts.stats
    out = {
        "decode_tok_s": s.decode_tok_s,
        "wall_s": wall,
        "cpu_s": (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime),  # all threads, user + kernel
        "bytes_read": e.bytes_read,
        "read_gb_s": e.bytes_read / wall / 1e9,
        "io_wait_s": e.wait_s,
        "experts_per_token": e.requested / (s.new_tokens + len(ids) - 1),
        "prefetch_issued": e.prefetch_issued, "prefetch_used": e.prefetch_used, "prefetch_wasted": e.prefetch_wasted,
        "recall_by_layer": {layer: round(r.recall, 3) for layer, r in sorted(e.layers.items()) if r.needed},
        "precision_by_layer": {layer: round(r.precision, 3) for layer, r in sorted(e.layers.items()) if r.predicted},
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "spine_bytes": (store / "spine.safetensors").stat().st_size,
        "spine_resident_bytes": spine_resident,
        "runtime_rss_bytes": runtime_rss,
        "cache_used_bytes": model.experts.cache.used_bytes,
        "free_read_buffers_bytes": model.experts.reader.buffers._free_bytes,
    }
    model.experts.uses.clear()  # keep the bench store's heat file out of it
    model.close()
    return out


def profile(store: Path, tokens: int, threads: int, prefetch: bool) -> None:
    """cProfile the main thread over one cold decode (cache 0) and print where it spent its time."""
    import cProfile
    import pstats

    __import__("deltafind")
    import torch

    from deltafind import Model
    from deltafind.engine.sampler import SamplingParams

    torch.set_num_threads(threads)
    model = Model.open(store, expert_cache_bytes=0, prefetch=prefetch, heat_decay=1.0)
    ids = [65, 66, 67, 68]
    list(model.stream(ids, SamplingParams(max_new_tokens=2, ignore_eos=True)))  # warm-up
    wait0, r0 = model.experts.stats.wait_s, resource.getrusage(resource.RUSAGE_SELF)
    prof = cProfile.Profile()
    prof.enable()
    list(model.stream(ids, SamplingParams(max_new_tokens=tokens, ignore_eos=True)))
    prof.disable()
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"decode_tok_s": round(model.last_stats.decode_tok_s, 3), "io_wait_s": round(model.experts.stats.wait_s - wait0, 3),
                      "cpu_user_s": round(r1.ru_utime - r0.ru_utime, 3), "cpu_kernel_s": round(r1.ru_stime - r0.ru_stime, 3)}))
    pstats.Stats(prof).sort_stats("tottime").print_stats(10)
    model.experts.uses.clear()
    model.close()


def run(cfg: dict, tree: Path | None = None) -> dict:
    env = dict(os.environ) if tree is None else dict(ENV)
    if tree is not None:  # the older checkout's deltafind package wins over the installed one
        env["PYTHONPATH"] = str(tree)
    proc = subprocess.run([sys.executable, __file__, "--one", json.dumps(cfg)], capture_output=True, text=True, check=False, env=env)
    if proc.returncode:
        raise SystemExit(proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def barrier_bound(stores: dict[int, Path], top_k: int = 8, samples: int = 4000) -> dict[int, float]:
    """Best speedup N drives can give when each layer's reads must finish before the next layer
    starts: mean reads per layer over the mean of the busiest drive's share (uniform routes, as the
    synthetic router's are, over the stores' actual striping)."""
    import random
    from collections import Counter

    from deltafind.store.manifest import Manifest

    out = {}
    for n, store in stores.items():
        drive = {r.key: r.drive for r in Manifest.load(store).experts}
        layers = sorted({k[0] for k in drive})
        counts = {layer: 1 + max(e for (lay, e) in drive if lay == layer) for layer in layers}
        rng, busiest = random.Random(0), 0
        for _ in range(samples):
            for layer in layers:
                busiest += max(Counter(drive[(layer, e)] for e in rng.sample(range(counts[layer]), top_k)).values())
        out[n] = round(samples * len(layers) * top_k / busiest, 3)
    return out


def summarize(res: dict[str, list[dict]], t: int, cap_mb_s: float) -> list[dict]:
    raw = median(res["raw"], "raw_gb_s")
    stream = res["stream"]
    efficiency = {"bench": "streaming_efficiency", "raw_odirect_gb_s": round(raw, 3), "decode_read_gb_s": round(median(stream, "read_gb_s"), 3),
                  "ratio": round(median(stream, "read_gb_s") / raw, 3), "decode_tok_s": round(median(stream, "decode_tok_s"), 3),
                  "io_wait_fraction": round(median(stream, "io_wait_s") / median(stream, "wall_s"), 3),
                  "bytes_per_token": int(median(stream, "bytes_read") / (t + 3)),
                  "cpu_ms_per_token": round(1e3 * median(stream, "cpu_s") / (t + 3), 1) if "cpu_s" in stream[0] else None}
    one_drive = median(res["cap1"], "decode_tok_s")
    scaling = {"bench": "drive_scaling", "cap_mb_s_per_drive": cap_mb_s,
               "tok_s": {n: round(median(res[f"cap{n}"], "decode_tok_s"), 3) for n in (1, 2, 3, 4)},
               "speedup": {n: round(median(res[f"cap{n}"], "decode_tok_s") / one_drive, 3) for n in (1, 2, 3, 4)}}
    prefetch = {"bench": "prefetch_value", "ratio_on_off": round(median(stream, "decode_tok_s") / median(res["noprefetch"], "decode_tok_s"), 3),
                "tok_s_on_off": [round(median(stream, "decode_tok_s"), 3), round(median(res["noprefetch"], "decode_tok_s"), 3)],
                "recall_by_layer": stream[-1]["recall_by_layer"], "precision_by_layer": stream[-1]["precision_by_layer"],
                "prefetch_used": stream[-1]["prefetch_used"], "prefetch_wasted": stream[-1]["prefetch_wasted"]}
    mem = res["mem"]
    peak = median(mem, "peak_rss_bytes")
    # The denominator is what the budgets allow: the spine as held (compute dtype) plus the cache budget.
    budget = mem[0].get("spine_resident_bytes", 2 * mem[0]["spine_bytes"]) + (1 << 30)
    runtime = median(mem, "runtime_rss_bytes") if "runtime_rss_bytes" in mem[0] else None
    memory = {"bench": "memory", "peak_rss_bytes": int(peak), "spine_resident_plus_cache_bytes": budget, "ratio": round(peak / budget, 3),
              "runtime_rss_bytes": runtime and int(runtime),
              "ratio_without_runtime": runtime and round((peak - runtime) / budget, 3),
              "cache_used_bytes": mem[0].get("cache_used_bytes"), "free_read_buffers_bytes": mem[0].get("free_read_buffers_bytes")}
    return [efficiency, scaling, prefetch, memory]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", type=Path, default=Path("/tmp/dfbench"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=6)
    ap.add_argument("--cap-mb-s", type=float, default=150.0, help="per-drive read cap for the scaling bench")
    ap.add_argument("--before", type=Path, help="an older checkout to run side by side (its deltafind/ package)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", type=Path, metavar="STORE", help="instead: cProfile one cold decode on STORE")
    ap.add_argument("--no-prefetch", action="store_true", help="with --profile")
    ap.add_argument("--prefetch-matrix", action="store_true", help="also: prefetch on/off, cold/warm x 1/4 drives x batch 1/8 (streaming_prefetch.py)")
    ap.add_argument("--prefill", action="store_true", help="also: prefill bytes per prompt token and a 512-token K3 prompt projected (streaming_prefill.py)")
    ap.add_argument("--one")
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(json.loads(args.one))))
        return
    if args.profile:
        profile(args.profile, max(2, args.tokens), args.threads, not args.no_prefetch)
        return
    args.root.mkdir(parents=True, exist_ok=True)
    stores = {n: make_store(args.root, n) for n in (1, 2, 3, 4)}
    t, th = args.tokens, args.threads
    trees: dict[str, Path | None] = {"after": None, **({"before": args.before} if args.before else {})}
    keys = ("raw", "stream", "noprefetch", "cap1", "cap2", "cap3", "cap4", "mem")
    res: dict[str, dict[str, list[dict]]] = {name: {k: [] for k in keys} for name in trees}
    for _ in range(args.rounds):
        configs = [("raw", {"store": str(stores[2]), "raw": True}),
                   ("stream", {"store": str(stores[2]), "tokens": t}),
                   ("noprefetch", {"store": str(stores[2]), "tokens": t, "prefetch": False}),
                   *[(f"cap{n}", {"store": str(stores[n]), "tokens": max(2, t // 2), "read_mb_s": args.cap_mb_s}) for n in (1, 2, 3, 4)],
                   ("mem", {"store": str(stores[2]), "tokens": t, "cache": 1 << 30})]
        for key, cfg in configs:
            for name, tree in trees.items():  # before and after back to back, so noise hits both
                res[name][key].append(run({**cfg, "threads": th}, tree))
    out = {name: summarize(r, t, args.cap_mb_s) for name, r in res.items()}
    bound = barrier_bound(stores)
    for lines in out.values():
        lines[1]["per_layer_barrier_bound"] = bound
    for name, lines in out.items():
        for line in lines:
            print(json.dumps({"tree": name, **line}))
    if "before" in out:
        pick = {"streaming_efficiency": "ratio", "prefetch_value": "ratio_on_off", "memory": "ratio"}
        for b, a in zip(out["before"], out["after"], strict=True):
            if b["bench"] in pick:
                print(json.dumps({"bench": b["bench"], "before": b[pick[b["bench"]]], "after": a[pick[b["bench"]]],
                                  "decode_tok_s_before_after": [b.get("decode_tok_s"), a.get("decode_tok_s")],
                                  "cpu_ms_per_token_before_after": [b.get("cpu_ms_per_token"), a.get("cpu_ms_per_token")]}))
            else:
                print(json.dumps({"bench": b["bench"], "before": b["speedup"], "after": a["speedup"], "tok_s_before": b["tok_s"], "tok_s_after": a["tok_s"]}))
    if args.prefetch_matrix:
        import streaming_prefetch

        for line in streaming_prefetch.matrix({n: stores[n] for n in (1, 4)}, args.rounds, args.tokens, args.cap_mb_s, th, trees, ENV):
            print(json.dumps(line), flush=True)
    if args.prefill:
        import streaming_prefill

        for line in streaming_prefill.bench(args.root, ENV, th):
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
