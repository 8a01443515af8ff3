"""Kimi K3 on a `bench` synthetic store (real-size MXFP4 experts): bytes, compute vs read, projection.

1. Cold decode through the streaming path with no expert cache: bytes read per
   token must equal 16 x MoE layers x expert bytes (plus the dense layer-0 slices).
2. One real-size expert (3 x 3072 x 3584 MXFP4, 17,547,264 B): fused-kernel compute
   time for one token vs the measured O_DIRECT read time, and vs a 7 GB/s drive.
3. Full-K3 decode projection for 1-4 drives at 7 GB/s from those per-expert costs.
4. DSpark: a 7-wide proposal and its commit vs the target's 1-row decode and
   8-row verify pass, warm and cold, measured alternately (`--dspark-only` for this alone).
5. Per core count (`--per-core-only` for this alone, no store needed): one
   expert of the real-width synthetic K3 (`full-layer`, hidden 7168) through the engine's expert
   path for 1 token and a decode batch, at 1..N threads alternately: compute / (read at 7 GB/s),
   and the cores that would keep up with 1 and 4 such drives (extrapolated from CPU time).

Prints one JSON line on stdout; progress on stderr. Creates the store if missing:
    python tests/bench/bench_kimi_k3.py --store /tmp/k3-bench [--threads 2] [--tokens 4]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from deltafind import Model
from deltafind.importer.setup import setup_store
from deltafind.importer.synthetic import open_synthetic
from deltafind.models import kimi_k3
from deltafind.models.ops.batch import SequenceCache, forward_step
from deltafind.models.ops.cpu_kernels import CPU, load_kernel
from deltafind.models.ops.latent_moe import mxfp4_expert_forward
from deltafind.models.ops.mxfp4 import dequantize, fused_linear
from deltafind.provider import Expert
from deltafind.store.buffers import record_tensors
from deltafind.store.manifest import Manifest
from deltafind.store.reader import PackReader

K3_MOE_LAYERS, K3_TOP_K, K3_EXPERT_BYTES = 92, 16, 17_547_264
K3_SPINE_PARAMS = 56.74e9  # docs/kimi-k3-format.md §1.5 (non-expert text params)
DRIVE_GB_S = 7.0


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def median_ms(fn, n: int) -> float:
    fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def ensure_store(store: Path, drives: list[Path]) -> None:
    if (store / "manifest.json").exists():
        return
    log(f"writing the bench store to {store} (real-size experts; a few GB)")
    t0 = time.perf_counter()
    setup_store(
        open_synthetic("kimi_k3", "bench"),
        store,
        drives or None,
        dense_slices=4,
        progress=False,
        names=kimi_k3.WEIGHTS,
    )
    log(f"store written in {time.perf_counter() - t0:.0f} s")


def cold_decode(store: Path, tokens: int) -> dict:
    model = Model.open(store, expert_bytes=0, prefetch=False)
    manifest, args = model.manifest, model.net.args
    moe_layers = sum(args.is_moe_layer(i) for i in range(args.num_hidden_layers))
    routed = next(r.length for r in manifest.experts if r.layer >= args.first_k_dense_replace)
    dense = sum(r.length for r in manifest.experts if r.layer < args.first_k_dense_replace)
    cache, ids = (
        SequenceCache(model.net.num_layers),
        model.tokenizer.encode("The capital of France is"),
    )
    per_token, times = [], []
    with torch.inference_mode():
        logits = forward_step(model.net, cache, ids)[-1]
        for _ in range(tokens):
            b0, t0 = model.experts.stats.bytes_read, time.perf_counter()
            logits = forward_step(model.net, cache, [int(logits.argmax())])[-1]
            times.append(time.perf_counter() - t0)
            per_token.append(model.experts.stats.bytes_read - b0)
    wait_s = model.experts.stats.wait_s
    model.close()
    want = K3_TOP_K * moe_layers * routed + dense
    return {
        "moe_layers": moe_layers,
        "expert_bytes": routed,
        "dense_slice_bytes_per_token": dense,
        "bytes_per_token": per_token,
        "expected_bytes_per_token": want,
        "bytes_match": all(b == want for b in per_token),
        "decode_s_per_token": round(statistics.median(times), 3),
        "io_wait_s_total": round(wait_s, 3),
    }


def expert_costs(store: Path, reads: int) -> dict:
    manifest = Manifest.load(store)
    recs = [r for r in manifest.experts if r.layer >= 1]
    reader = PackReader(manifest, store, verify=False)  # pure I/O; the checksum is timed on its own
    read_ms = []
    # distinct records, O_DIRECT where the filesystem allows it: cold reads
    for rec in recs[:reads]:
        t0 = time.perf_counter()
        buf = reader.read(rec)
        read_ms.append((time.perf_counter() - t0) * 1e3)
    tensors = {n: t.clone() for n, t in record_tensors(recs[0], buf).items()}
    reader.release(buf)
    reader.close()
    blob = bytes(memoryview(torch.cat([t.reshape(-1) for t in tensors.values()]).numpy()))
    sha_ms = median_ms(lambda: hashlib.sha256(blob).digest(), 5)
    expert = Expert(tensors, recs[0].length)
    latent = tensors["w1.weight_packed"].shape[1] * 2
    r = torch.randn(1, latent)
    compute_ms = median_ms(lambda: mxfp4_expert_forward(r, expert), 20)
    w1p, w1s = tensors["w1.weight_packed"], tensors["w1.weight_scale"]
    matvec_ms = median_ms(lambda: fused_linear(r, w1p, w1s), 20)
    deq_ms = median_ms(lambda: dequantize(w1p, w1s), 3)
    rb = torch.randn(16, latent)
    batch16_ms = median_ms(lambda: fused_linear(rb, w1p, w1s), 5)
    widen_ms = median_ms(lambda: [t.to(torch.float32).to(torch.uint8) for t in tensors.values()], 5)
    read_med = statistics.median(read_ms)
    drive_ms = K3_EXPERT_BYTES / (DRIVE_GB_S * 1e9) * 1e3
    return {
        "expert_read_ms_median": round(read_med, 3),
        "expert_read_gb_s": round(recs[0].length / read_med / 1e6, 2),
        "expert_sha256_ms": round(sha_ms, 3),
        "expert_compute_ms": round(compute_ms, 3),
        "matvec_3072x3584_ms": round(matvec_ms, 3),
        "dequantize_3072x3584_ms": round(deq_ms, 2),
        "fused_16_tokens_3072x3584_ms": round(batch16_ms, 2),
        "widen_to_fp32_and_back_ms": round(widen_ms, 2),
        "compute_over_read_measured": round(compute_ms / read_med, 3),
        "compute_over_read_7gb_s": round(compute_ms / drive_ms, 3),
        "read_ms_at_7gb_s": round(drive_ms, 3),
    }


def expert_per_core(threads: list[int], batch: int, reps: int, block: int = 6) -> dict:
    """One real-width K3 expert through `mxfp4_expert_forward` (what `LatentMoE.run` calls), at each
    thread count in turn (alternating, so all see the same moments of a shared machine). Wall time
    gives compute / read; process CPU time per expert is the per-core cost the extrapolation uses."""
    from deltafind.importer.synthetic import open_synthetic

    source = open_synthetic(
        "kimi_k3", "full-layer"
    )  # real widths: hidden 7168, latent 3584, moe_inter 3072
    prefix = "model.layers.1.block_sparse_moe.experts.0."
    names = [f"{w}.weight_{k}" for w in ("w1", "w2", "w3") for k in ("packed", "scale")]
    tensors = {n: source.load(prefix + n) for n in names}
    nbytes = sum(t.nbytes for t in tensors.values())
    expert = Expert(tensors, nbytes)
    latent = source.config["text_config"]["routed_expert_hidden_size"]
    rows = {
        n: torch.randn(n, latent, generator=torch.Generator().manual_seed(n)) for n in (1, batch)
    }
    wall: dict[tuple[int, int], list[float]] = {(t, n): [] for t in threads for n in rows}
    cpu: dict[tuple[int, int], list[float]] = {(t, n): [] for t in threads for n in rows}
    with torch.inference_mode():
        for t in threads:  # warm: the kernel's pool grows to each count once
            torch.set_num_threads(t)
            for x in rows.values():
                mxfp4_expert_forward(x, expert)
        for _ in range(reps):
            for t in threads:
                torch.set_num_threads(t)
                for n, x in rows.items():
                    # Blocks of back-to-back calls, as a decode layer makes them: a lone call after a
                    # pause pays the VM's wake-up of an idle vCPU (measured here: 2 threads no faster).
                    mxfp4_expert_forward(x, expert)
                    c0, w0 = time.process_time(), time.perf_counter()
                    for _ in range(block):
                        mxfp4_expert_forward(x, expert)
                    wall[(t, n)].append((time.perf_counter() - w0) * 1e3 / block)
                    cpu[(t, n)].append((time.process_time() - c0) * 1e3 / block)
    read_ms = nbytes / (DRIVE_GB_S * 1e9) * 1e3
    out: dict = {
        "expert_bytes": nbytes,
        "hidden": source.config["text_config"]["hidden_size"],
        "latent": latent,
        "read_ms_at_7gb_s": round(read_ms, 3),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "os_cpu_count": os.cpu_count(),
        "threads_timed": threads,
        "loadavg": [round(v, 2) for v in os.getloadavg()],
    }
    for n in rows:
        per: dict = {}
        for t in threads:
            w, c = statistics.median(wall[(t, n)]), statistics.median(cpu[(t, n)])
            per[f"threads_{t}"] = {
                "wall_ms": round(w, 3),
                "cpu_ms": round(c, 3),
                "compute_over_read_7gb_s": round(w / read_ms, 3),
                "speedup_over_1_thread": round(statistics.median(wall[(threads[0], n)]) / w, 2),
            }
        core_ms = statistics.median(
            cpu[(threads[0], n)]
        )  # one thread's CPU time: one core's cost per expert read
        per["cpu_ms_per_core_1_thread"] = round(core_ms, 3)
        per["extrapolated_cores_to_keep_up"] = {
            f"drives_{d}": round(core_ms / (read_ms / d), 1) for d in (1, 4)
        }
        out[f"tokens_{n}"] = per
    out["note"] = (
        "cores_to_keep_up = one core's CPU ms per expert / (read ms at 7 GB/s / drives): extrapolated, "
        "assuming linear scaling with cores; a batch reads the expert once for all its tokens"
    )
    return out


def dspark_costs(store: Path, context: int, reps: int) -> dict:
    """DSpark (docs/kimi-k3-drafting-io.md §7) on this store's shape: one 7-wide proposal and one commit of 8 context rows,
    timed against the target's warm 1-row decode and 8-row verify pass, side by side."""
    from deltafind.engine.draft.dspark import DSparkSource
    from deltafind.importer.dspark_import import write_synthetic_dspark
    from deltafind.models.ops.batch import Batch
    from deltafind.store.dspark import DRAFT_DIR

    if not (store / DRAFT_DIR).is_dir():
        write_synthetic_dspark(store, seed=0)
    model = Model.open(
        store, expert_bytes=None, prefetch=False
    )  # every expert kept once read: warm passes
    net = model.net
    source = DSparkSource.open(store, net)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, net.args.vocab_size - 256, (context,), generator=g).tolist()
    cache = SequenceCache(net.num_layers)
    session = source.session(ids)
    with torch.inference_mode():
        batch = Batch.of([(cache, len(ids))])
        batch.capture = source.capture_layers
        net(torch.tensor(ids), batch)
        rows = torch.cat([batch.captured[i] for i in source.capture_layers], dim=-1)  # [L, 5H]
        session.commit([*ids, 1], rows)

        # a verify pass of 8 rows, then a cut to 4 of them (the KDA rerun included)
        def verify() -> None:
            forward_step(net, cache, [5, 6, 7, 8, 9, 10, 11, 12], all_logits=True)
            cache.truncate(cache.length - 4)

        # one plain decode row (the context grows by one each time: negligible)
        def decode() -> None:
            forward_step(net, cache, [5])

        for _ in range(4):  # warm: the experts these rows route to are read once here
            decode()
            verify()

        def propose() -> None:
            source.model.propose(session.ctx, 5, 7)

        def commit() -> None:
            source.model.extend(session.ctx, rows[:8])
            session.ctx.truncate(session.ctx.length - 8)

        times: dict[str, list[float]] = {"decode": [], "verify": [], "propose": [], "commit": []}
        # alternately, so every ratio compares the same moments of a shared machine
        for _ in range(reps):
            for name, fn in (
                ("decode", decode),
                ("verify", verify),
                ("propose", propose),
                ("commit", commit),
            ):
                t0 = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t0) * 1e3)
        decode_ms, verify_ms, propose_ms, commit_ms = (
            statistics.median(times[n]) for n in ("decode", "verify", "propose", "commit")
        )
    model.close()
    # Cold (no expert cache, O_DIRECT reads): what a streaming K3 pays per pass.
    cold = Model.open(store, expert_bytes=0, prefetch=False)
    cache = SequenceCache(cold.net.num_layers)
    cold_times: dict[str, list[float]] = {"decode": [], "verify": []}
    with torch.inference_mode():
        forward_step(cold.net, cache, ids[:16])
        for _ in range(3):
            for name, rows_in in (("decode", [5]), ("verify", [5, 6, 7, 8, 9, 10, 11, 12])):
                t0 = time.perf_counter()
                forward_step(cold.net, cache, rows_in, all_logits=True)
                if len(rows_in) > 1:
                    cache.truncate(cache.length - len(rows_in) // 2)
                cold_times[name].append((time.perf_counter() - t0) * 1e3)
    cold.close()
    cold_decode_ms, cold_verify_ms = (
        statistics.median(cold_times["decode"]),
        statistics.median(cold_times["verify"]),
    )
    a = source.model.args
    return {
        "target_decode_1row_cold_ms": round(cold_decode_ms, 1),
        "target_verify_8rows_cold_ms": round(cold_verify_ms, 1),
        "draft_step_over_decode_cold": round(
            (propose_ms + commit_ms + cold_verify_ms) / cold_decode_ms, 3
        ),
        "context_positions": context,
        "dspark_hidden": a.hidden_size,
        "dspark_heads": a.num_attention_heads,
        "target_decode_1row_warm_ms": round(decode_ms, 2),
        "target_verify_8rows_warm_ms": round(verify_ms, 2),
        "dspark_propose_w7_ms": round(propose_ms, 2),
        "dspark_commit_8rows_ms": round(commit_ms, 2),
        "propose_over_decode": round(propose_ms / decode_ms, 3),
        "verify8_over_decode": round(verify_ms / decode_ms, 3),
        "draft_step_over_decode": round((propose_ms + commit_ms + verify_ms) / decode_ms, 3),
        "note": "a 7-wide draft step pays when it emits more tokens than draft_step_over_decode(_cold)",
    }


def spine_gb_s() -> float:
    w = torch.randn(8192, 8192)
    x = torch.randn(1, 8192)
    ms = median_ms(lambda: torch.nn.functional.linear(x, w), 10)
    return w.numel() * 4 / ms / 1e6  # fp32 weight bytes streamed per second by a matvec


def project(compute_ms: float, spine_rate_gb_s: float) -> dict:
    """tok/s = 1 / (max(E*c, E*b/(d*R)) + S/M): reads overlap expert compute; the spine is extra."""
    experts = K3_MOE_LAYERS * K3_TOP_K
    t_compute = experts * compute_ms / 1e3
    t_spine = (
        K3_SPINE_PARAMS * 4 / (spine_rate_gb_s * 1e9)
    )  # fp32-resident spine, one matvec pass per token
    out = {
        "formula": "t = max(E*c, E*B/(d*R)) + S*4/M; E=92*16, B=17547264, R=7e9 B/s, c=expert compute, S=spine params, M=measured fp32 matvec B/s",
        "experts_per_token": experts,
        "expert_compute_s_per_token": round(t_compute, 3),
        "spine_s_per_token": round(t_spine, 2),
    }
    for d in (1, 2, 3, 4):
        t_read = experts * K3_EXPERT_BYTES / (d * DRIVE_GB_S * 1e9)
        out[f"drives_{d}"] = {
            "read_s": round(t_read, 3),
            "experts_only_tok_s": round(1 / max(t_read, t_compute), 3),
            "with_spine_tok_s": round(1 / (max(t_read, t_compute) + t_spine), 4),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--store", type=Path, default=Path("/tmp/k3-bench"))
    p.add_argument(
        "--drive",
        type=Path,
        action="append",
        default=[],
        help="drive folders when creating the store",
    )
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--tokens", type=int, default=4)
    p.add_argument("--reads", type=int, default=32)
    p.add_argument(
        "--dspark-context", type=int, default=256, help="committed positions DSpark drafts over"
    )
    p.add_argument("--dspark-only", action="store_true", help="time only the DSpark section")
    p.add_argument(
        "--per-core-only",
        action="store_true",
        help="time only one real-width expert per thread count",
    )
    p.add_argument(
        "--batch", type=int, default=8, help="decode rows routed to one expert in the batch case"
    )
    a = p.parse_args()
    if load_kernel() is None:
        log(f"warning: MXFP4 kernel unavailable ({CPU.build_error}); timing the torch fallback")
    per_core_threads = list(range(1, len(os.sched_getaffinity(0)) + 1))
    log(f"per-core: one real-width expert at threads {per_core_threads} ...")
    per_core = expert_per_core(per_core_threads, a.batch, 9)
    if a.per_core_only:
        print(
            json.dumps(
                {"bench": "kimi_k3", "kernel": load_kernel() is not None, "per_core": per_core}
            )
        )
        return
    torch.set_num_threads(a.threads)
    ensure_store(a.store, a.drive)
    log("dspark ...")
    dspark = dspark_costs(a.store, a.dspark_context, 7)
    if a.dspark_only:
        print(json.dumps({"bench": "kimi_k3", "threads": a.threads, "dspark": dspark}))
        return
    log("cold decode ...")
    decode = cold_decode(a.store, a.tokens)
    log("per-expert costs ...")
    costs = expert_costs(a.store, a.reads)
    rate = spine_gb_s()
    result = {
        "bench": "kimi_k3",
        "threads": a.threads,
        "kernel": load_kernel() is not None,
        "cold_decode": decode,
        "expert": costs,
        "spine_matvec_gb_s": round(rate, 2),
        "projection": project(costs["expert_compute_ms"], rate),
        "dspark": dspark,
        "per_core": per_core,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
