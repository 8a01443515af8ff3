"""Structured output cost: per-token mask time of llguidance, outlines-core and xgrammar on the demo's 49k
vocabulary and a synthetic 160k-token byte-level BPE (K3's size), what the engine thread pays per token with
the next mask built inline vs overlapped with a (stand-in) forward pass, and the daemon's decode slowdown with
json_schema on vs off, measured side by side in one run.

    python tests/bench/bench_structured.py [--store ~/.cache/deltafind/demo] [--xgrammar-path DIR]
    python tests/bench/bench_structured.py --only-decode --no-daemon --pairs 24 --tokens 16   # the firm slowdown figure

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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `tests.` below, run as a script

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "hourly": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"t": {"type": "number"}, "sky": {"enum": ["sun", "rain", "cloud"]}},
                "required": ["t", "sky"],
            },
            "maxItems": 24,
        },
        "note": {"type": "string"},
    },
    "required": ["city", "days", "hourly", "note"],
}
ANSWER = json.dumps(
    {
        "city": "Paris",
        "days": 3,
        "hourly": [
            {"t": 20.5, "sky": "sun"},
            {"t": 18.25, "sky": "cloud"},
            {"t": 15, "sky": "rain"},
        ]
        * 3,
        "note": "Bring an umbrella on the third day; mornings are cool.",
    }
)
FORWARD_S = (
    0.005  # a stand-in forward pass for the engine-thread rows (the demo decodes a token in 10+ ms)
)


def synthetic_tokenizer(size: int = 163_840, seed: int = 0):
    """A K3-sized byte-level BPE (tiktoken ranks -> `tokenizers`), every token a merge of two earlier ones."""
    from deltafind.tokenizer import Tokenizer
    from deltafind.tokenizer.bpe import KIMI_PATTERN, make_tiktoken_backend

    rng = random.Random(seed)
    ranks: dict[bytes, int] = {bytes([b]): b for b in range(256)}
    letters = [
        bytes([c]) for c in b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 "
    ]
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
    m = llg.LLMatcher(
        lt,
        llg.LLMatcher.grammar_from_json_schema(
            SCHEMA, overrides={**JSON_STYLE, "whitespace_flexible": True}
        ),
    )
    compile_s = time.perf_counter() - t0
    times = []
    for tok in ids:
        t0 = time.perf_counter()
        m.compute_bitmask()
        times.append(time.perf_counter() - t0)
        assert m.consume_token(tok), ("llguidance refused", tokenizer.decode([tok]))
    rows.append(("llguidance", setup, compile_s, times))
    # What the engine thread pays per token: the mask as a bool tensor applied to [V] logits, and the advance.
    # "inline": the mask waited for right after the advance (as when it was built on the engine thread);
    # "overlapped": a forward pass (a GIL-free sleep of FORWARD_S) runs while the worker builds it.
    import torch

    from deltafind.engine.constraint import apply
    from deltafind.server.structured import Grammar

    grammar = Grammar(
        tokenizer,
        llg.LLMatcher.grammar_from_json_schema(
            SCHEMA, overrides={**JSON_STYLE, "whitespace_flexible": True}
        ),
        "bench",
    )
    logits = torch.randn(n)
    for name, overlap in (("  engine inline", False), ("  engine overlap", True)):
        con = grammar.factory()()
        times = []
        for tok in ids:
            if overlap:
                time.sleep(FORWARD_S)
            t0 = time.perf_counter()
            apply(logits, con)
            assert con.advance(tok)
            if not overlap:
                con.allowed()
            times.append(time.perf_counter() - t0)
        rows.append((name, 0.0, 0.0, times))

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
        index = oc.Index(
            oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA), whitespace_pattern=r"[ ]?"),
            vocab,
        )
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
            info = xgr.TokenizerInfo(
                enc, xgr.VocabType.RAW, vocab_size=n, stop_token_ids=list(tokenizer.eos_token_ids)
            )
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
    print(
        f"  {'library':<14} {'vocab setup s':>13} {'compile ms':>10} {'mask us median':>15} {'p90':>8} {'max':>8}"
    )
    for name, setup, compile_s, times in rows:
        us = sorted(t * 1e6 for t in times)
        print(
            f"  {name:<14} {setup:13.2f} {compile_s * 1e3:10.1f} {statistics.median(us):15.1f} "
            f"{us[int(len(us) * 0.9)]:8.1f} {us[-1]:8.1f}"
        )


def engine_slowdown(store: Path, tokens: int = 16, pairs: int = 24) -> None:
    """The engine core in-process on the demo, batch 1, greedy, one engine for every run: decode per token
    without a constraint, with a grammar that admits exactly the free answer ("same tokens": the same
    forward passes, only the constraint's cost differs) and with json_schema, in rounds of short
    generations whose order rotates and reverses, so drift on a shared machine falls on every config
    alike. Per round each config's cost against that round's "off" run; the median of those ratios with
    its spread (p25..p75, min..max), on the wall clock and on this thread's CPU clock (the engine thread:
    forward, sampler and what the constraint does here; masks built on worker threads do not count).
    Beside it the constraint's own engine-thread time per token, timed around `apply` (waiting for the
    mask, masking the logits) and `advance`: the work not overlapped with the forward, the upper bound
    it puts on the slowdown."""
    import os

    import torch

    from deltafind.api import Model
    from deltafind.engine import sequence
    from deltafind.engine.core import EngineCore
    from deltafind.engine.generate import ONE_AT_A_TIME
    from deltafind.engine.sampler import SamplingParams
    from deltafind.engine.sequence import FinishEvent, GenRequest
    from deltafind.server.structured import Grammar, json_schema_grammar, lark_literal

    model = Model.open(store)
    tok = model.tokenizer
    core = EngineCore(model.net, model.eos_token_ids, ONE_AT_A_TIME)  # one engine, no prefix reuse
    # a prompt the demo answers at length (the JSON one it ends after 25 tokens)
    prompt = tuple(
        tok.apply_chat_template(
            [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
        )
    )
    params = SamplingParams(max_new_tokens=tokens + 1, temperature=0.0)
    spent = [0.0, 0.0]  # the constraint's engine-thread (wall, CPU) seconds in the current run

    def timed(fn):
        def call(*a, **kw):
            w, c = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                spent[0] += time.perf_counter() - w
                spent[1] += time.thread_time() - c

        return call

    class Timed:  # the constraint as the engine sees it, its engine-thread calls timed
        def __init__(self, inner) -> None:
            self.inner, self.allowed, self.advance, self.rollback = (
                inner,
                inner.allowed,
                timed(inner.advance),
                inner.rollback,
            )

        @property
        def done(self) -> bool:
            return self.inner.done

    apply = sequence.apply_constraint
    sequence.apply_constraint = lambda logits, c: (
        timed(apply)(logits, c) if c is not None else logits
    )

    def run(factory) -> tuple[float, float, float, float, list[int]]:
        """(wall, CPU, constraint wall, constraint CPU) seconds per decoded token, and the tokens."""
        core.add(
            GenRequest(prompt, params, constraint=(lambda: Timed(factory())) if factory else None),
            0,
        )
        out, wall, cpu, first = [], 0.0, 0.0, True
        while core.has_work:
            w, c = time.perf_counter(), time.thread_time()
            events = core.step()
            if not first:  # decode steps only; the prompt's prefill is not what a mask slows
                wall += time.perf_counter() - w
                cpu += time.thread_time() - c
            first = False
            for _, e in events:
                if isinstance(e, FinishEvent):
                    assert e.reason in ("length", "stop"), (
                        e
                    )  # the literal grammar ends with the answer
                else:
                    out.append(e.token_id)
                    if len(out) == 1:
                        spent[0] = spent[1] = (
                            0.0  # the first token's mask came from the prefill step
                        )
        n = len(out) - 1
        return wall / n, cpu / n, spent[0] / n, spent[1] / n, out

    free = run(None)[4]
    assert not set(free) & set(model.eos_token_ids), "the free answer ended early"
    same = Grammar(tok, f"start: {lark_literal(tok.decode(free))}", "bench").factory()
    long_text = {
        "type": "object",
        "properties": {"text": {"type": "string", "minLength": 2000}},
        "required": ["text"],
    }
    schema = Grammar(tok, json_schema_grammar(long_text, "bench"), "bench").factory()
    configs = {"off": None, "same tokens": same, "json_schema": schema}
    for f in configs.values():  # warm-up
        run(f)
    load0 = os.getloadavg()
    res: dict[str, list[tuple[float, float, float, float]]] = {k: [] for k in configs}
    names = list(configs)
    for i in range(pairs):
        order = names[i % 3 :] + names[: i % 3]
        for name in order if i % 2 == 0 else reversed(order):
            *t, out = run(configs[name])
            if name == "same tokens":
                assert out == free, "the literal grammar changed the greedy answer"
            res[name].append(tuple(t))
    load1 = os.getloadavg()
    sequence.apply_constraint = apply
    print(
        f"\nengine in-process, demo, batch 1, greedy, {tokens} decoded tokens a run, {pairs} rounds "
        f"(order rotated and reversed), torch threads {torch.get_num_threads()}, load average "
        f"{load0[0]:.1f} -> {load1[0]:.1f}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    print(
        f"  {'config':<12} {'clock':<5} {'ms/token':>9} {'per-round ratio - 1: median':>28} {'p25..p75':>16} {'min..max':>16}"
        f" {'constraint on engine thread':>28}"
    )
    for name, rows in res.items():
        for k, clock in enumerate(("wall", "CPU")):
            ratios = sorted(100 * (r[k] / o[k] - 1) for r, o in zip(rows, res["off"], strict=True))
            q = statistics.quantiles(ratios, n=4)
            own = statistics.median(r[2 + k] for r in rows)
            share = 100 * statistics.median(r[2 + k] / r[k] for r in rows)
            print(
                f"  {name:<12} {clock:<5} {1e3 * statistics.median(r[k] for r in rows):9.2f} {statistics.median(ratios):+27.1f} %"
                f" {q[0]:+7.1f}..{q[2]:+6.1f} % {ratios[0]:+7.1f}..{ratios[-1]:+6.1f} %"
                f" {1e6 * own:10.0f} us = {share:5.2f} % of a step"
            )
    model.close()


def decode_slowdown(store: Path, tokens: int = 96, reps: int = 5) -> None:
    """The daemon on the demo store: decode tokens/s with json_schema vs without, alternated in one run
    (off-on, then on-off, ...), each pair's ratio and their median, with the load average around them."""
    import os

    import openai

    from tests.e2e.daemon_fixtures import Daemon

    d = Daemon(store, "[server]\nmax_running = 1\n[draft]\nmode = \"off\"\n").start()
    try:
        c = openai.OpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0, timeout=600)
        long_text = {
            "type": "object",
            "properties": {"text": {"type": "string", "minLength": 2000}},
            "required": ["text"],
        }
        # one prompt both runs answer at length (to the "..., as JSON." one the demo stops after 25 tokens unconstrained)
        msgs = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]
        fmt = {"type": "json_schema", "json_schema": {"name": "story", "schema": long_text}}

        def run(constrained: bool) -> float:
            kw = {"response_format": fmt} if constrained else {}
            first = last = None
            n = 0
            for ch in c.chat.completions.create(
                model="test-model",
                messages=msgs,
                max_tokens=tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                **kw,
            ):
                now = time.perf_counter()
                if ch.usage:
                    n = ch.usage.completion_tokens
                elif ch.choices and ch.choices[0].delta.content:
                    first = first or now
                    last = now
            return (n - 1) / (last - first)

        run(False)  # warm-up: both prompts cached, the grammar vocabulary built
        run(True)
        load0 = os.getloadavg()
        on, off, ratios = [], [], []
        for i in range(reps):
            order = (False, True) if i % 2 == 0 else (True, False)
            got = {k: run(k) for k in order}
            off.append(got[False])
            on.append(got[True])
            ratios.append(got[False] / got[True])
        load1 = os.getloadavg()
        a, b = statistics.median(off), statistics.median(on)
        print(
            f"\ndecode on the demo, batch 1, {tokens} tokens, {reps} alternated pairs: off {a:.1f} tok/s, json_schema {b:.1f} tok/s "
            f"(medians); slowdown per pair {', '.join(f'{100 * (r - 1):+.1f}' for r in ratios)} %, "
            f"median {100 * (statistics.median(ratios) - 1):+.1f} %; load average {load0[0]:.1f} -> {load1[0]:.1f}"
        )
    finally:
        d.stop()
        d.cleanup()


def first_request(store: Path, rounds: int = 3) -> None:
    """A fresh daemon per round: the latency of the first json_schema request, sent as soon as /health says
    ready, and of the same request again; where the grammar vocabulary was built (the daemon's log)."""
    import os
    import re

    from tests.e2e.daemon_fixtures import Daemon

    body = {
        "model": "test-model",
        "max_tokens": 8,
        "temperature": 0,
        "messages": [{"role": "user", "content": "A city, as JSON."}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {
                "name": "c",
                "schema": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
            },
        },
    }
    print(f"\nfirst constrained request after ready (load average {os.getloadavg()[0]:.1f}):")
    for _ in range(rounds):
        d = Daemon(store, "[server]\nmax_running = 1\n").start()
        try:
            times = []
            for _ in range(2):
                t0 = time.perf_counter()
                status, _ = d.post_json("/v1/chat/completions", body, timeout=600)
                assert status == 200
                times.append(time.perf_counter() - t0)
            line = next(
                (
                    ln
                    for ln in d.log_text(full=True).splitlines()
                    if "grammar_vocabulary_built" in ln
                ),
                "",
            )
            fields = dict(re.findall(r'"(seconds|thread)": "?([\w.-]+)', line))
            where = (
                f"vocabulary built in {fields.get('seconds')} s on {fields.get('thread')}"
                if line
                else "no grammar_vocabulary_built log line"
            )
            print(
                f"  first {times[0]:.2f} s, second {times[1]:.2f} s, first - second {times[0] - times[1]:+.2f} s; {where}"
            )
        finally:
            d.stop()
            d.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", type=Path, default=Path.home() / ".cache/deltafind/demo")
    ap.add_argument("--xgrammar-path")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument(
        "--first-request",
        action="store_true",
        help="only the first-request latency on fresh daemons",
    )
    ap.add_argument("--only-decode", action="store_true", help="skip the mask-cost tables")
    ap.add_argument(
        "--reps",
        type=int,
        default=5,
        help="alternated off/on pairs for the daemon's decode slowdown",
    )
    ap.add_argument(
        "--pairs",
        type=int,
        default=24,
        help="rounds of the in-process slowdown (each runs off, same tokens, json_schema)",
    )
    ap.add_argument(
        "--tokens", type=int, default=16, help="decoded tokens per run of the in-process slowdown"
    )
    ap.add_argument("--no-daemon", action="store_true", help="skip the daemon's decode slowdown")
    args = ap.parse_args()
    from deltafind.tokenizer import Tokenizer

    if not args.only_decode:
        mask_cost(Tokenizer.load(args.store / "tokenizer"), "demo (SmolLM2)", args.xgrammar_path)
        mask_cost(synthetic_tokenizer(), "synthetic 160k byte-level BPE", args.xgrammar_path)
    if args.first_request:
        first_request(args.store)
        return
    if not args.skip_decode:
        engine_slowdown(args.store, tokens=args.tokens, pairs=args.pairs)
        if not args.no_daemon:
            decode_slowdown(args.store, reps=args.reps)


if __name__ == "__main__":
    main()
