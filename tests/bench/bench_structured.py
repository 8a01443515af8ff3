"""Structured output cost: per-token mask time of llguidance, outlines-core and xgrammar on the demo's 49k
vocabulary and a synthetic 160k-token byte-level BPE (K3's size), and the daemon's decode slowdown with
json_schema on vs off, measured side by side in one run.

    python tests/bench/bench_structured.py [--store ~/.cache/deltafind/demo] [--xgrammar-path DIR]

xgrammar pulls triton into an environment, so it is not a project dependency: install it with
`pip install --no-deps --target DIR xgrammar apache-tvm-ffi` and pass DIR to include it.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 40}, "days": {"type": "integer", "minimum": 1, "maximum": 14},
    "hourly": {"type": "array", "items": {"type": "object", "properties": {"t": {"type": "number"}, "sky": {"enum": ["sun", "rain", "cloud"]}},
                                          "required": ["t", "sky"]}, "maxItems": 24},
    "note": {"type": "string"}}, "required": ["city", "days", "hourly", "note"]}
ANSWER = json.dumps({"city": "Paris", "days": 3, "hourly": [{"t": 20.5, "sky": "sun"}, {"t": 18.25, "sky": "cloud"},
                                                             {"t": 15, "sky": "rain"}] * 3,
                     "note": "Bring an umbrella on the third day; mornings are cool."})


def synthetic_tokenizer(size: int = 163_840, seed: int = 0):
    """A K3-sized byte-level BPE (tiktoken ranks -> `tokenizers`), every token a merge of two earlier ones."""
    from deltafind.tokenizer import Tokenizer
    from deltafind.tokenizer.bpe import KIMI_PATTERN, make_tiktoken_backend

    rng = random.Random(seed)
    ranks: dict[bytes, int] = {bytes([b]): b for b in range(256)}
    letters = [bytes([c]) for c in b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 "]
    pool = list(letters)
    while len(ranks) < size - 2:
        a, b = rng.choice(pool), rng.choice(pool if rng.random() < 0.7 else letters)
        t = a + b
        if len(t) <= 10 and t not in ranks and not t.endswith(b" ") and (b" " not in t[1:]):
            ranks[t] = len(ranks)
            pool.append(t)
    specials = {"<|end_of_msg|>": size - 2, "[EOS]": size - 1}
    backend = make_tiktoken_backend(ranks, KIMI_PATTERN, specials)
    return Tokenizer(backend, {"eos_token": "<|end_of_msg|>"})


def mask_cost(tokenizer, label: str, xgrammar_path: str | None) -> None:
    ids = tokenizer.encode(ANSWER)
    n = tokenizer.vocab_size
    rows = []

    import llguidance as llg

    from deltafind.server.structured import JSON_STYLE, vocabulary
    t0 = time.perf_counter()
    lt = vocabulary(tokenizer)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    m = llg.LLMatcher(lt, llg.LLMatcher.grammar_from_json_schema(SCHEMA, overrides={**JSON_STYLE, "whitespace_flexible": True}))
    compile_s = time.perf_counter() - t0
    times = []
    for tok in ids:
        t0 = time.perf_counter()
        m.compute_bitmask()
        times.append(time.perf_counter() - t0)
        assert m.consume_token(tok), ("llguidance refused", tokenizer.decode([tok]))
    rows.append(("llguidance", setup, compile_s, times))
    # What the engine pays per token: the mask as a bool tensor, applied to [V] logits, then advance.
    import torch

    from deltafind.engine.constraint import apply
    from deltafind.server.structured import Grammar
    con = Grammar(tokenizer, llg.LLMatcher.grammar_from_json_schema(SCHEMA, overrides={**JSON_STYLE, "whitespace_flexible": True}),
                  "bench").factory()()
    logits = torch.randn(n)
    times = []
    for tok in ids:
        t0 = time.perf_counter()
        apply(logits, con)
        assert con.advance(tok)
        times.append(time.perf_counter() - t0)
    rows.append(("  engine step", 0.0, 0.0, times))

    try:
        import outlines_core as oc
        t0 = time.perf_counter()
        by_bytes: dict[bytes, list[int]] = {}
        for i in range(n):
            if i in tokenizer.eos_token_ids:
                continue
            by_bytes.setdefault(lt.decode_bytes([i]), []).append(i)
        vocab = oc.Vocabulary(tokenizer.eos_token_ids[0], {k: v for k, v in by_bytes.items() if k})
        setup = time.perf_counter() - t0
        t0 = time.perf_counter()
        index = oc.Index(oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA), whitespace_pattern=r"[ ]?"), vocab)
        compile_s = time.perf_counter() - t0
        guide = oc.Guide(index)
        mask = np.zeros((n + 31) // 32, dtype=np.int32)
        times = []
        for tok in ids:
            t0 = time.perf_counter()
            guide.write_mask_into(mask.ctypes.data, mask.size, mask.itemsize)
            times.append(time.perf_counter() - t0)
            guide.advance(tok)
        rows.append(("outlines-core", setup, compile_s, times))
    except Exception as e:  # report, do not hide, a library that cannot run this case
        print(f"  outlines-core on {label}: failed: {type(e).__name__}: {str(e)[:160]}")

    if xgrammar_path:
        sys.path.insert(0, xgrammar_path)
        try:
            import torch
            import xgrammar as xgr
            t0 = time.perf_counter()
            enc = [lt.decode_bytes([i]) for i in range(n)]
            info = xgr.TokenizerInfo(enc, xgr.VocabType.RAW, vocab_size=n, stop_token_ids=list(tokenizer.eos_token_ids))
            compiler = xgr.GrammarCompiler(info)
            setup = time.perf_counter() - t0
            t0 = time.perf_counter()
            compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=True)
            compile_s = time.perf_counter() - t0
            matcher = xgr.GrammarMatcher(compiled)
            bitmask = xgr.allocate_token_bitmask(1, n)
            times = []
            for tok in ids:
                t0 = time.perf_counter()
                matcher.fill_next_token_bitmask(bitmask)
                times.append(time.perf_counter() - t0)
                assert matcher.accept_token(tok)
            rows.append(("xgrammar", setup, compile_s, times))
            del torch
        except Exception as e:
            print(f"  xgrammar on {label}: failed: {type(e).__name__}: {str(e)[:160]}")

    print(f"\n{label}: vocabulary {n}, answer {len(ids)} tokens")
    print(f"  {'library':<14} {'vocab setup s':>13} {'compile ms':>10} {'mask us median':>15} {'p90':>8} {'max':>8}")
    for name, setup, compile_s, times in rows:
        us = sorted(t * 1e6 for t in times)
        print(f"  {name:<14} {setup:13.2f} {compile_s * 1e3:10.1f} {statistics.median(us):15.1f} "
              f"{us[int(len(us) * 0.9)]:8.1f} {us[-1]:8.1f}")


def decode_slowdown(store: Path, tokens: int = 96, reps: int = 3) -> None:
    """The daemon on the demo store: decode tokens/s with json_schema vs without, alternated in one run."""
    import openai

    from tests.e2e.daemon_fixtures import Daemon

    d = Daemon(store, "[server]\nmax_running = 1\n[draft]\nmode = \"off\"\n").start()
    try:
        c = openai.OpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0, timeout=600)
        long_text = {"type": "object", "properties": {"text": {"type": "string", "minLength": 2000}}, "required": ["text"]}
        msgs = [{"role": "user", "content": "Write a long story about a lighthouse keeper, as JSON."}]

        def run(fmt: dict | None) -> float:
            kw = {"response_format": fmt} if fmt else {}
            first = last = None
            n = 0
            for ch in c.chat.completions.create(model="test-model", messages=msgs, max_tokens=tokens, temperature=0, stream=True,
                                                stream_options={"include_usage": True}, **kw):
                now = time.perf_counter()
                if ch.usage:
                    n = ch.usage.completion_tokens
                elif ch.choices and ch.choices[0].delta.content:
                    first = first or now
                    last = now
            return (n - 1) / (last - first)

        run(None)  # warm-up
        on, off = [], []
        for _ in range(reps):
            off.append(run(None))
            on.append(run({"type": "json_schema", "json_schema": {"name": "story", "schema": long_text}}))
        a, b = statistics.median(off), statistics.median(on)
        print(f"\ndecode on the demo, batch 1, {tokens} tokens, median of {reps}: off {a:.1f} tok/s, json_schema {b:.1f} tok/s, "
              f"slowdown {100 * (a / b - 1):.1f} %")
    finally:
        d.stop()
        d.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", type=Path, default=Path.home() / ".cache/deltafind/demo")
    ap.add_argument("--xgrammar-path")
    ap.add_argument("--skip-decode", action="store_true")
    args = ap.parse_args()
    from deltafind.tokenizer import Tokenizer

    mask_cost(Tokenizer.load(args.store / "tokenizer"), "demo (SmolLM2)", args.xgrammar_path)
    mask_cost(synthetic_tokenizer(), "synthetic 160k byte-level BPE", args.xgrammar_path)
    if not args.skip_decode:
        decode_slowdown(args.store)


if __name__ == "__main__":
    main()
