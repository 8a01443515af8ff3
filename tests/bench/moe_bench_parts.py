"""bench_moe_vs_llamacpp.py's parts that know neither engine: the Qwen3-30B-A3B-shaped GGUF and its store,
the worker processes (each engine in its own, optionally in a memory cgroup), and the logit drift of a
`[device] math` mode. Not run in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).with_name("bench_moe_vs_llamacpp.py")  # the workers run it with --serve

# Qwen3-30B-A3B's config.json, but the layer count (--layers)
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, TOP_K, EXPERT_FF, VOCAB = (
    2048,
    32,
    4,
    128,
    128,
    8,
    768,
    151936,
)


def more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits (llama-quant.cpp): the layers Q4_K_M gives Q6_K attn_v / ffn_down."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def make_gguf(path: Path, layers: int, seed: int = 0) -> None:
    """llama.cpp's Q4_K_M for qwen3moe: Q4_K, with Q6_K output, and Q6_K attn_v / ffn_down_exps on more_bits layers."""
    from tests.gguf_models import Builder

    b = Builder("qwen3moe", seed, vocab=VOCAB)
    for key, value in (
        ("context_length", 40960),
        ("embedding_length", HIDDEN),
        ("block_count", layers),
        ("attention.head_count", HEADS),
        ("attention.head_count_kv", KV_HEADS),
        ("attention.layer_norm_rms_epsilon", 1e-6),
        ("rope.freq_base", 1000000.0),
        ("vocab_size", VOCAB),
        ("attention.key_length", HEAD_DIM),
        ("attention.value_length", HEAD_DIM),
        ("expert_count", EXPERTS),
        ("expert_used_count", TOP_K),
        ("expert_feed_forward_length", EXPERT_FF),
    ):
        b.meta(key, value)
    b.weight("token_embd.weight", (VOCAB, HIDDEN), "Q4_K", scale=1.0)
    b.norm("output_norm.weight", HIDDEN)
    b.weight("output.weight", (VOCAB, HIDDEN), "Q6_K")
    for i in range(layers):
        wide = "Q6_K" if more_bits(i, layers) else "Q4_K"
        b.norm(f"blk.{i}.attn_norm.weight", HIDDEN)
        b.norm(f"blk.{i}.ffn_norm.weight", HIDDEN)
        b.weight(f"blk.{i}.attn_q.weight", (HEADS * HEAD_DIM, HIDDEN), "Q4_K")
        b.weight(f"blk.{i}.attn_k.weight", (KV_HEADS * HEAD_DIM, HIDDEN), "Q4_K")
        b.weight(f"blk.{i}.attn_v.weight", (KV_HEADS * HEAD_DIM, HIDDEN), wide)
        b.weight(f"blk.{i}.attn_output.weight", (HIDDEN, HEADS * HEAD_DIM), "Q4_K")
        b.norm(f"blk.{i}.attn_q_norm.weight", HEAD_DIM)
        b.norm(f"blk.{i}.attn_k_norm.weight", HEAD_DIM)
        b.weight(f"blk.{i}.ffn_gate_inp.weight", (EXPERTS, HIDDEN), "F32")
        b.weight(f"blk.{i}.ffn_gate_exps.weight", (EXPERTS, EXPERT_FF, HIDDEN), "Q4_K")
        b.weight(f"blk.{i}.ffn_up_exps.weight", (EXPERTS, EXPERT_FF, HIDDEN), "Q4_K")
        b.weight(f"blk.{i}.ffn_down_exps.weight", (EXPERTS, HIDDEN, EXPERT_FF), wide)
    tmp = path.with_suffix(".part.gguf")
    b.write(tmp)
    tmp.rename(path)


def make_store(gguf: Path, store: Path) -> None:
    from deltafind.importer.checkpoint import open_source
    from deltafind.importer.setup import setup_store
    from deltafind.models.registry import family_module

    source = open_source(gguf)
    family = family_module(source.config["model_type"])
    setup_store(
        source,
        store,
        progress=False,
        names=family.weight_names(family.ModelArgs.from_config(source.config)),
    )


def logit_drift(store: Path, maths: list[str], tokens: int, threads: int) -> dict:
    """Each non-exact mode's teacher-forced logits against exact's on the same random ids."""
    import random

    import torch
    from bench_fast_math import drift_stats

    from deltafind import Model

    torch.set_num_threads(threads)
    rng = random.Random(1)
    ids = [rng.randrange(VOCAB) for _ in range(tokens)]
    logits = {}
    for math in ["exact", *(m for m in maths if m != "exact")]:
        model = Model.open(str(store), device="cpu", expert_bytes=None, math=math)
        try:
            logits[math] = model.forward_logits(ids)
        finally:
            model.close()
    return {
        f"drift_{m}": drift_stats(logits["exact"], v) for m, v in logits.items() if m != "exact"
    }


def memory_cgroup(name: str, limit: int) -> Path:
    """A child of this process's memory cgroup limited to `limit` bytes (v1 or v2)."""
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    v1 = next((ln.split(":", 2)[2] for ln in lines if ln.split(":")[1] == "memory"), None)
    if v1 is not None:
        path, knob = Path("/sys/fs/cgroup/memory" + v1) / name, "memory.limit_in_bytes"
    else:
        path, knob = Path("/sys/fs/cgroup" + lines[0].split(":", 2)[2]) / name, "memory.max"
    path.mkdir(exist_ok=True)
    (path / knob).write_text(str(limit))
    return path


def drop_from_page_cache(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class WorkerDied(RuntimeError):
    pass


class Worker:
    def __init__(
        self,
        name: str,
        a: argparse.Namespace,
        threads: int,
        cache_bytes: int | None,
        cgroup: Path | None,
    ) -> None:
        cmd = [
            sys.executable,
            BENCH,
            "--serve",
            name,
            "--root",
            str(a.root),
            "--threads",
            str(threads),
            "--gguf",
            str(a.gguf),
            "--store",
            str(a.store),
        ] + (["--expert-bytes", str(cache_bytes)] if cache_bytes else [])
        cmd += ["--read-all"] if a.read_all and not cache_bytes else []
        procs = None if cgroup is None else cgroup / "cgroup.procs"

        # in the child, before exec: the engine's every page is charged to the cgroup
        def enter() -> None:
            if procs is not None:
                procs.write_text(str(os.getpid()))

        self.name = name
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, preexec_fn=enter
        )
        hello = self.proc.stdout.readline()
        if not hello:
            raise WorkerDied(
                f"the {name} worker died while loading (exit status {self.proc.wait()}; killed by the memory cap?)"
            )
        self.info = json.loads(hello)

    def gen(self, ids: list[int], n: int, temperature: float = 0.0) -> dict:
        self.seed = (
            getattr(self, "seed", 0) + 1
        )  # sampled: every call draws new tokens (and routes anew)
        self.proc.stdin.write(
            json.dumps({"ids": ids, "n": n, "temperature": temperature, "seed": self.seed}) + "\n"
        )
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise WorkerDied(
                f"the {self.name} worker died (exit status {self.proc.wait()}; killed by the memory cap?)"
            )
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=120)
