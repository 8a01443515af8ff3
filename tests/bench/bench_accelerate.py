"""deltafind vs HF transformers + accelerate disk offload: decode tok/s, same checkpoint, same memory.

One small random qwen3_moe checkpoint (transformers `from_config` + `save_pretrained`,
fp32) is imported with `deltafind setup --from` and loaded by transformers with
`device_map="auto"`, `max_memory={"cpu": BUDGET}` and `offload_folder`, so what does not
fit the budget is offloaded to disk by accelerate. deltafind gets the same budget:
its resident spine plus an expert cache of the rest. Each engine decodes greedily in
its own fresh process, engines alternating round by round; the greedy tokens are
compared too (same weights, fp32 both). Prints one JSON line per run and a summary.

accelerate reads its offload through np.memmap, so on a machine with spare RAM the
OS page cache quietly holds the offloaded weights and the budget is not what binds.
`hf_cold` therefore also runs it with the offload files' cached pages dropped
(POSIX_FADV_DONTNEED) before every forward, as when the model really exceeds RAM;
deltafind reads with O_DIRECT, so its figure is cold either way.

    pip install -e '.[bench]'      # accelerate
    python tests/bench/bench_accelerate.py --root /tmp/dfaccel [--budget-mib 400] [--tokens 8] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

SHAPE = {
    "vocab_size": 1024,
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "moe_intermediate_size": 768,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "norm_topk_prob": True,
    "max_position_embeddings": 512,
    "eos_token_id": 256,
    "bos_token_id": None,
    "pad_token_id": None,
}
PROMPT = [65, 66, 67, 68, 69, 70, 71, 72]


def make(root: Path) -> tuple[Path, Path]:
    ckpt, store = root / "hf", root / "store"
    if not (ckpt / "config.json").exists():
        import torch
        import transformers as T

        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        from tests.conftest import write_tiny_tokenizer

        torch.manual_seed(0)
        model = T.AutoModelForCausalLM.from_config(
            T.Qwen3MoeConfig(**SHAPE, initializer_range=0.05), torch_dtype=torch.float32
        )
        model.save_pretrained(ckpt)
        write_tiny_tokenizer(ckpt)
    if not (store / "manifest.json").exists():
        from deltafind.importer.setup import setup_store

        setup_store(ckpt, store, [store / "drive0"], progress=False)
    return ckpt, store


def peak_rss() -> int:
    """VmHWM: unlike ru_maxrss it is not inherited from the parent across exec."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))


def drop_page_cache(folder: Path) -> None:
    for f in folder.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def run_hf(cfg: dict) -> dict:
    import torch
    import transformers as T

    torch.set_num_threads(cfg["threads"])
    offload = Path(cfg["root"]) / "offload"
    shutil.rmtree(offload, ignore_errors=True)
    t0 = time.perf_counter()
    model = T.AutoModelForCausalLM.from_pretrained(
        cfg["ckpt"],
        torch_dtype=torch.float32,
        device_map="auto",
        max_memory={"cpu": cfg["budget"]},
        offload_folder=str(offload),
    ).eval()
    load_s = time.perf_counter() - t0
    placement = {str(v) for v in getattr(model, "hf_device_map", {}).values()}
    if cfg["engine"] == "hf_cold":
        model.register_forward_pre_hook(lambda *_: drop_page_cache(offload))
    ids = torch.tensor([PROMPT])
    model.generation_config.eos_token_id = (
        None  # decode exactly `tokens` tokens, as deltafind's ignore_eos does
    )
    model.generation_config.pad_token_id = 0
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, do_sample=False)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=cfg["tokens"], do_sample=False)
        total = time.perf_counter() - t0
    tokens = out[0, len(PROMPT) :].tolist()
    return {
        "engine": cfg["engine"],
        "decode_tok_s": (len(tokens) - 1) / max(1e-9, total - first),
        "tokens": tokens,
        "load_s": load_s,
        "placement": sorted(placement),
        "peak_rss_bytes": peak_rss(),
    }


def run_df(cfg: dict) -> dict:
    __import__("deltafind")  # first: its OpenMP defaults apply before torch loads
    import torch

    from deltafind import Model
    from deltafind.engine.sampler import SamplingParams

    torch.set_num_threads(cfg["threads"])
    t0 = time.perf_counter()
    probe = Model.open(cfg["store"], expert_bytes=0, prefetch=False)
    spine = sum(p.numel() * p.element_size() for p in probe.net.parameters())
    probe.experts.uses.clear()
    probe.close()
    model = Model.open(
        cfg["store"],
        expert_bytes=max(0, cfg["budget"] - spine),
        prefetch=True,
        heat_decay=1.0,
    )
    load_s = time.perf_counter() - t0
    tokens = list(
        model.stream(PROMPT, SamplingParams(max_new_tokens=cfg["tokens"], ignore_eos=True))
    )
    out = {
        "engine": "deltafind",
        "decode_tok_s": model.last_stats.decode_tok_s,
        "tokens": tokens,
        "load_s": load_s,
        "spine_bytes": spine,
        "cache_bytes": max(0, cfg["budget"] - spine),
        "experts_read": model.experts.stats.read,
        "peak_rss_bytes": peak_rss(),
    }
    model.experts.uses.clear()
    model.close()
    return out


def spawn(engine: str, cfg: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--one", json.dumps({**cfg, "engine": engine})],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode:
        raise SystemExit(proc.stderr[-4000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", type=Path, default=Path("/tmp/dfaccel"))
    ap.add_argument("--budget-mib", type=int, default=400, help="memory for weights, both engines")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--one")
    args = ap.parse_args()
    if args.one:
        cfg = json.loads(args.one)
        print(json.dumps(run_df(cfg) if cfg["engine"] == "df" else run_hf(cfg)))
        return
    args.root.mkdir(parents=True, exist_ok=True)
    ckpt, store = make(args.root)
    cfg = {
        "ckpt": str(ckpt),
        "store": str(store),
        "root": str(args.root),
        "budget": args.budget_mib << 20,
        "tokens": args.tokens,
        "threads": args.threads,
    }
    rows: dict[str, list[dict]] = {"hf": [], "hf_cold": [], "df": []}
    for _ in range(args.rounds):
        for engine in rows:
            r = spawn(engine, cfg)
            rows[engine].append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "tokens"}))
    hf, cold, df = (
        statistics.median(r["decode_tok_s"] for r in rows[e]) for e in ("hf", "hf_cold", "df")
    )
    weights = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    print(
        json.dumps(
            {
                "bench": "vs_hf_accelerate_disk_offload",
                "budget_bytes": cfg["budget"],
                "checkpoint_bytes": weights,
                "hf_page_cache_warm_tok_s": round(hf, 3),
                "hf_cold_tok_s": round(cold, 3),
                "deltafind_tok_s": round(df, 3),
                "ratio_vs_cold": round(df / cold, 2),
                "ratio_vs_warm": round(df / hf, 2),
                "hf_placement": rows["hf"][0]["placement"],
                "peak_rss_bytes": {
                    e: int(statistics.median(r["peak_rss_bytes"] for r in rows[e])) for e in rows
                },
                "same_greedy_tokens": rows["hf"][0]["tokens"]
                == rows["df"][0]["tokens"]
                == rows["hf_cold"][0]["tokens"],
            }
        )
    )


if __name__ == "__main__":
    main()
