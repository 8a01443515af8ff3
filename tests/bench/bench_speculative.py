"""Speculative decoding: decode speedup at identical output, and acceptance rate.

Configurations (drafting off, each draft source, `auto`) alternate prompt by
prompt in one process, so machine noise hits all of them alike; every drafted
output is checked token for token against drafting off. Greedy decoding.

    python tests/bench/bench_speculative.py --store ~/.cache/deltafind/demo [--tokens 64] [--rounds 2]
    python tests/bench/bench_speculative.py --store ... --sweep-layers 4,8,12,16,20   # choose the self-draft depth
    python tests/bench/bench_speculative.py --synthetic /tmp/dfspec --read-mb-s 400   # a streaming store

Prints one JSON line per configuration and a summary line.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

CHAT = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List the days of the week.",
    "Repeat this sentence twice: the quick brown fox jumps over the lazy dog.",
    "Write a Python function that returns the square of a number.",
    "Give me three tips for sleeping better.",
    "Count from one to ten in words.",
]
RAW = [
    "The capital of France is",
    "Once upon a time",
    "def fib(n):",
    "1, 2, 3, 4,",
    "The quick brown fox",
    "Hello",
]


def synthetic_store(root: Path) -> Path:
    """A seeded qwen3_moe store whose experts stream from disk (bench_streaming.py's shape, 2 layers)."""
    import deltafind.importer.synthetic_families  # noqa: F401 - registers the families
    from deltafind.importer.setup import setup_store
    from deltafind.importer.synthetic import FAMILIES, open_synthetic

    store = root / "q1"
    if not (store / "manifest.json").exists():
        fam = FAMILIES["qwen3_moe"]
        fam.shapes["bench-stream"] = {**fam.shapes["bench"], "layers": 2}
        setup_store(
            open_synthetic("qwen3_moe", "bench-stream", 0),
            store,
            [root / "q1-drive0"],
            progress=False,
        )
    return store


def row_costs(net, prompt: list[int], rounds: int) -> dict:
    """Median seconds of one pass of r rows after `prompt` (rows alternate), and each ratio to one row."""
    import statistics

    import torch

    from deltafind.models.ops.batch import SequenceCache, forward_step

    times: dict[int, list[float]] = {r: [] for r in (1, 2, 3, 4, 8)}
    with torch.inference_mode():
        cache = SequenceCache(net.num_layers)
        forward_step(net, cache, prompt)
        base = cache.length
        for _ in range(max(3, 3 * rounds)):
            for r in times:
                t0 = time.perf_counter()
                forward_step(
                    net,
                    cache,
                    prompt[-r:] if len(prompt) >= r else [prompt[-1]] * r,
                    all_logits=True,
                )
                times[r].append(time.perf_counter() - t0)
                cache.truncate(base)
    med = {r: statistics.median(v) for r, v in times.items()}
    return {
        "bench": "speculative_row_costs",
        "pass_s": {r: round(v, 4) for r, v in med.items()},
        "ratio_to_one_row": {r: round(v / med[1], 2) for r, v in med.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--store",
        type=Path,
        default=Path(os.environ.get("DELTAFIND_HOME", "~/.cache/deltafind")).expanduser() / "demo",
    )
    ap.add_argument(
        "--synthetic",
        type=Path,
        help="root folder for a streaming synthetic qwen3_moe store (instead of --store)",
    )
    ap.add_argument(
        "--read-mb-s",
        type=float,
        default=None,
        help="cap the streaming store's drive (emulates a slower drive)",
    )
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=len(CHAT))
    ap.add_argument(
        "--sources",
        default="self,ngram,auto",
        help="comma list of --draft values to compare with off",
    )
    ap.add_argument(
        "--self-layers", type=int, default=None, help="self-draft depth (default: the source's)"
    )
    ap.add_argument("--width", type=int, default=7)
    ap.add_argument(
        "--sweep-layers",
        default="",
        help="comma list: compare self-draft depths instead of sources",
    )
    ap.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    ap.add_argument(
        "--row-costs",
        action="store_true",
        help="only time one target pass of 1, 2, 3, 4, 8 rows (what a verify costs)",
    )
    args = ap.parse_args()

    import torch

    from deltafind import Model
    from deltafind.engine.draft.load import make_draft_source
    from deltafind.engine.draft.policy import DraftStats, PolicyOptions
    from deltafind.engine.draft.self_draft import SelfDraftSource
    from deltafind.engine.generate import GenerationStats, generate
    from deltafind.engine.sampler import SamplingParams
    from deltafind.store.reader import DriveOptions

    torch.set_num_threads(args.threads)
    if args.synthetic:
        store = synthetic_store(args.synthetic)
        model = Model.open(store, expert_bytes=0, drives=[DriveOptions(read_mb_s=args.read_mb_s)])
        prompts = [model.tokenizer.encode(p) for p in RAW[: args.prompts]]
    else:
        store = args.store
        model = Model.open(store)
        tok = model.tokenizer
        prompts = [
            tok.apply_chat_template([{"role": "user", "content": c}]) for c in CHAT[: args.prompts]
        ]
    net, eos = model.net, model.eos_token_ids
    if args.row_costs:
        print(json.dumps(row_costs(net, prompts[0], args.rounds)))
        model.close()
        return

    configs: dict[str, tuple[object, PolicyOptions | None]] = {"off": (None, None)}
    if args.sweep_layers:
        for n in [int(x) for x in args.sweep_layers.split(",")]:
            configs[f"self{n}"] = (
                SelfDraftSource(net, n),
                PolicyOptions(mode="on", max_width=args.width),
            )
    else:
        for name in args.sources.split(","):
            spec = f"self:{args.self_layers}" if name == "self" and args.self_layers else name
            source, mode = make_draft_source(spec, net, target_store=store)
            configs[name] = (source, PolicyOptions(mode=mode, max_width=args.width))

    params = SamplingParams(max_new_tokens=args.tokens)
    ref: dict[int, list[int]] = {}
    totals = {
        name: {
            "decode_s": 0.0,
            "steps": 0,
            "identical": True,
            "draft": DraftStats(),
            "per_prompt_s": [0.0] * len(prompts),
        }
        for name in configs
    }
    for p in prompts[:1]:  # warm-up
        list(generate(net, p, SamplingParams(max_new_tokens=4), eos))
    t_all = time.perf_counter()
    for _ in range(args.rounds):
        for i, prompt in enumerate(prompts):
            for name, (source, policy) in configs.items():
                st, ds = GenerationStats(), DraftStats()
                out = list(
                    generate(
                        net,
                        prompt,
                        params,
                        eos,
                        st,
                        draft=source,
                        draft_policy=policy,
                        draft_stats=ds,
                    )
                )
                if name == "off":
                    ref.setdefault(i, out)
                tot = totals[name]
                tot["identical"] = tot["identical"] and out == ref[i]
                tot["decode_s"] += st.decode_s
                tot["per_prompt_s"][i] += st.decode_s
                tot["steps"] += max(
                    st.new_tokens - 1, 0
                )  # tokens decoded after the first (prefill's)
                tot["draft"].add(ds)
    base = totals["off"]
    summary = {}
    for name, tot in totals.items():
        d = tot["draft"]
        row = {
            "bench": "speculative",
            "store": str(store),
            "config": name,
            "tokens": tot["steps"],
            "decode_tok_s": round(tot["steps"] / tot["decode_s"], 2) if tot["decode_s"] else 0.0,
            "speedup": round(base["decode_s"] / tot["decode_s"], 3) if tot["decode_s"] else 0.0,
            "identical": tot["identical"],
            "acceptance_rate": round(d.acceptance_rate, 3),
            "proposed": d.proposed,
            "accepted": d.accepted,
            "verify_passes": d.steps,
            "tokens_per_verify": round(d.emitted / d.steps, 2) if d.steps else 0.0,
            "draft_s": round(d.draft_s, 3),
            "verify_s": round(d.verify_s, 3),
            "speedup_per_prompt": [
                round(b / t, 2) if t else 0.0
                for b, t in zip(base["per_prompt_s"], tot["per_prompt_s"], strict=True)
            ],
        }
        print(json.dumps(row), flush=True)
        summary[name] = row["speedup"]
    print(
        json.dumps(
            {
                "bench": "speculative_summary",
                "speedup": summary,
                "rounds": args.rounds,
                "prompts": len(prompts),
                "tokens": args.tokens,
                "threads": args.threads,
                "wall_s": round(time.perf_counter() - t_all, 1),
            }
        )
    )
    model.close()


if __name__ == "__main__":
    main()
