"""A Qwen3-30B-A3B-shaped MoE GGUF: deltafind vs llama.cpp on the same file, fitting in memory and capped.

Not run in CI. Writes a random `qwen3moe` GGUF of Qwen3-30B-A3B's shapes (hidden 2048, 32 query / 4 KV
heads of 128, 128 experts of 768, top-8, vocab 151,936) with --layers of its 48 layers, in llama.cpp's
Q4_K_M mix (tests/gguf_models.py's random blocks), and imports it with `setup_store`. Each engine runs
in its own worker process (bench_demo_vs_llamacpp.py's LlamaCppEngine at llama.cpp's own defaults:
flash attention on, mmap on; the settings are printed), greedy from the same random token ids, each
decoding exactly --new-tokens (EOS ignored), which engine runs first alternating by round; medians:

- decode tok/s = (n_new - 1) / (t[generate n_new] - t[generate 1]) at 1 and 2 threads (the experts
  routed to stay resident: deltafind's expert cache unlimited, the GGUF in the page cache; with
  --read-all deltafind reads every expert into that cache first, the whole model in memory);
- the time of a 512-token prompt plus one token (`--prefill-tokens`) at --prefill-threads;
- decode with each worker in its own memory cgroup capped at --cap-fraction (0.4) of the GGUF's size
  (cgroup v1 memory.limit_in_bytes or v2 memory.max, under this process's cgroup: run as root), the
  GGUF and the store dropped from the page cache first (pages charged elsewhere would not count);
  deltafind's expert cache gets --cap-cache-fraction of the cap, and it reads experts with O_DIRECT.
  Greedy decoding of this random model repeats one token, which routes every step to the same 8
  experts a layer: a working set that fits under the cap, unlike real text's. So under the cap both
  engines sample at --cap-temperature (100: nearly uniform over the vocabulary, a new seed per call),
  and every token routes anew. llama.cpp at its defaults (repacking K-quants into anonymous memory)
  is tried first; the comparison runs it with use_extra_bufts off (--no-repack: all weights mmapped).

`--math exact,q8` runs a deltafind worker per `[device] math` mode beside llama.cpp (`deltafind` is
exact, `deltafind_q8` llama.cpp's own int8-activation arithmetic, docs/math-modes.md), all alternating,
with `ratio_q8` / `cpu_ratio_q8` against llama.cpp (the prefill's `ratio_speed_q8` likewise), and prints how far each mode's teacher-forced
logits over --drift-tokens lie from exact's (`drift_q8`: bench_fast_math.py's measure).

    python tests/bench/bench_moe_vs_llamacpp.py --root /tmp/dfmoe [--layers 8] [--rounds 3] [--new-tokens 32]
        [--math exact,q8]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[2]))
from bench_demo_vs_llamacpp import LlamaCppEngine
from moe_bench_parts import (
    Worker,
    WorkerDied,
    drop_from_page_cache,
    logit_drift,
    make_gguf,
    make_store,
    memory_cgroup,
)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class DeltafindEngine:
    name = "deltafind"

    def __init__(
        self, store: Path, cache_bytes: int | None, math: str = "exact", read_all: bool = False
    ) -> None:
        import deltafind
        from deltafind import Model

        self.version = getattr(deltafind, "__version__", "unknown")
        self.settings = {"expert_bytes": cache_bytes, "math": math, "read_all": read_all}
        self.model = m = Model.open(str(store), device="cpu", expert_bytes=cache_bytes, math=math)
        for layer in range(m.net.num_layers) if read_all else ():  # the whole model in memory
            for _ in m.experts.fetch(layer, range(m.experts.num_experts(layer))):
                pass

    def generate(
        self, ids: list[int], n: int, temperature: float = 0.0, seed: int = 0
    ) -> list[int]:
        from deltafind.engine.sampler import SamplingParams

        params = SamplingParams(
            max_new_tokens=n, temperature=temperature, seed=seed, ignore_eos=True
        )
        return list(self.model.stream(ids, params))


def llamacpp_generate(
    engine: LlamaCppEngine, ids: list[int], n: int, temperature: float, seed: int
) -> list[int]:
    """LlamaCppEngine.generate, sampling at `temperature` (softmax of the last row, numpy's generator)."""
    if temperature == 0.0:
        return engine.generate(ids, n)
    import numpy as np

    llm, rng, out = engine.llm, np.random.default_rng(seed), []
    llm.reset()
    llm.eval(ids)
    while True:
        row = (
            np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(engine.n_vocab,)).astype(
                np.float64
            )
            / temperature
        )
        p = np.exp(row - row.max())
        out.append(int(rng.choice(len(p), p=p / p.sum())))
        if len(out) == n:
            return out
        llm.eval([out[-1]])


def serve(a: argparse.Namespace) -> None:
    """Worker: JSON requests on stdin, one JSON reply per line on stdout."""
    reply, sys.stdout = sys.stdout, sys.stderr  # engines' prints must not corrupt the replies
    if a.serve.startswith("llamacpp"):
        import llama_cpp.llama_cpp as llama_cpp  # where llama_cpp.Llama looks the defaults up

        repack = a.serve == "llamacpp"
        if not repack:  # llama.cpp's --no-repack (the binding has no keyword for it)
            defaults = llama_cpp.llama_model_default_params

            def no_repack() -> object:
                params = defaults()
                params.use_extra_bufts = False
                return params

            llama_cpp.llama_model_default_params = no_repack
        engine = LlamaCppEngine(a.gguf, a.threads)
        engine.name = a.serve
        # the binding's and llama.cpp's defaults, not passed: mmap, and repacking into its CPU_REPACK buffer
        engine.settings = {**engine.settings, "use_mmap": True, "use_extra_bufts": repack}
    else:
        import deltafind  # noqa: F401, I001  first, as the daemon does: it sets OMP_WAIT_POLICY before torch loads
        import torch

        torch.set_num_threads(a.threads)
        with contextlib.suppress(RuntimeError):
            torch.set_num_interop_threads(1)
        read_all = a.read_all and a.expert_bytes is None
        engine = DeltafindEngine(a.store, a.expert_bytes, worker_math(a.serve), read_all)
    reply.write(json.dumps({"version": engine.version, "settings": engine.settings}) + "\n")
    reply.flush()
    for line in sys.stdin:
        req = json.loads(line)
        t0, c0 = time.perf_counter(), time.process_time()
        t, seed = req.get("temperature", 0.0), req.get("seed", 0)
        if isinstance(engine, DeltafindEngine):
            out = engine.generate(req["ids"], req["n"], t, seed)
        else:
            out = llamacpp_generate(engine, req["ids"], req["n"], t, seed)
        reply.write(
            json.dumps(
                {"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0, "ids": out}
            )
            + "\n"
        )
        reply.flush()


def worker_math(name: str) -> str:
    """A deltafind worker's `[device] math` from its name: "deltafind" exact, "deltafind_q8" q8."""
    return name.split("_", 1)[1] if "_" in name else "exact"


def deltafind_name(math: str) -> str:
    return "deltafind" if math == "exact" else f"deltafind_{math}"


def decode_rounds(
    workers: list[Worker], ids: list[int], n: int, rounds: int, label: str, temperature: float = 0.0
) -> dict:
    """Median decode tok/s (wall and CPU) per engine, and each engine's greedy tokens."""
    out: dict[str, dict] = {w.name: {"tok_s": [], "cpu_tok_s": []} for w in workers}
    for w in workers:  # warm-up: load, fault the file in / make the experts resident
        out[w.name]["ids"] = w.gen(ids, n, temperature)["ids"]
        w.gen(ids, 1, temperature)
        log(f"{label} {w.name}: warmed")
    for r in range(rounds):
        for w in workers if r % 2 == 0 else workers[::-1]:
            one, full = w.gen(ids, 1, temperature), w.gen(ids, n, temperature)
            if len(full["ids"]) != n:
                sys.exit(f"{w.name} decoded {len(full['ids'])} tokens, not {n}")
            tok_s = (n - 1) / (full["wall"] - one["wall"])
            cpu_tok_s = (n - 1) / max(full["cpu"] - one["cpu"], 1e-9)
            out[w.name]["tok_s"].append(round(tok_s, 3))
            out[w.name]["cpu_tok_s"].append(round(cpu_tok_s, 3))
            log(
                f"{label} round {r + 1}/{rounds} {w.name}: {tok_s:.2f} decode tok/s ({cpu_tok_s:.2f} per CPU-s)"
            )
    return summarize(out)


def prefill_rounds(workers: list[Worker], ids: list[int], rounds: int) -> dict:
    out: dict[str, dict] = {w.name: {"s": []} for w in workers}
    for w in workers:
        w.gen(ids, 1)
    for r in range(rounds):
        for w in workers if r % 2 == 0 else workers[::-1]:
            s = w.gen(ids, 1)["wall"]
            out[w.name]["s"].append(round(s, 3))
            log(f"prefill round {r + 1}/{rounds} {w.name}: {len(ids)} tokens + 1 in {s:.2f} s")
    res = {
        name: {"median_s": statistics.median(v["s"]), "samples": v["s"]} for name, v in out.items()
    }
    for name in (n for n in out if n.startswith("deltafind")):  # ratio_speed, ratio_speed_q8, ...
        speed = res["llamacpp"]["median_s"] / res[name]["median_s"]
        res[f"ratio_speed{name[len('deltafind') :]}"] = round(speed, 4)
    return res


def summarize(out: dict[str, dict]) -> dict:
    """Medians per engine; each deltafind worker's ratios to llama.cpp (`ratio`, or `ratio_q8` for
    deltafind_q8) and how many greedy tokens it shares with llama.cpp's before the first difference."""
    res = {
        name: {
            "tok_s": statistics.median(v["tok_s"]),
            "cpu_tok_s": statistics.median(v["cpu_tok_s"]),
            "samples": v["tok_s"],
        }
        for name, v in out.items()
    }
    other = next(name for name in out if not name.startswith("deltafind"))
    for name in (n for n in out if n.startswith("deltafind")):
        tail = name[len("deltafind") :]
        res[f"ratio{tail}"] = round(res[name]["tok_s"] / res[other]["tok_s"], 4)
        res[f"cpu_ratio{tail}"] = round(res[name]["cpu_tok_s"] / res[other]["cpu_tok_s"], 4)
        a, b = out[name]["ids"], out[other]["ids"]
        res[f"greedy_same_prefix_tokens{tail}"] = next(
            (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a)
        )
    res["distinct_tokens"] = {name: len(set(v["ids"])) for name, v in out.items()}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--root", type=Path, required=True, help="where the GGUF and the store are made (once)"
    )
    ap.add_argument(
        "--layers", type=int, default=8, help="of Qwen3-30B-A3B's 48 (8: a 3.45 GB GGUF)"
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", default="1,2", help="decode thread counts when the model fits")
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--prefill-threads", type=int, default=2)
    ap.add_argument("--prefill-rounds", type=int, default=2)
    ap.add_argument("--cap-fraction", type=float, default=0.4)
    ap.add_argument(
        "--cap-cache-fraction",
        type=float,
        default=0.25,
        help="deltafind's expert cache, of the cap",
    )
    ap.add_argument("--cap-threads", type=int, default=2)
    ap.add_argument("--cap-new-tokens", type=int, default=8)
    ap.add_argument(
        "--cap-temperature",
        type=float,
        default=100.0,
        help="sampling temperature under the cap (0: greedy); see the module docstring",
    )
    ap.add_argument("--only", default="decode,prefill,cap")
    ap.add_argument(
        "--math",
        default="exact",
        help="deltafind's [device] math modes to run: exact, q8, exact,q8",
    )
    ap.add_argument("--drift-tokens", type=int, default=64, help="positions of the logit drift")
    ap.add_argument("--serve", default=None, help=argparse.SUPPRESS)  # a worker process (internal)
    ap.add_argument("--gguf", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--store", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--expert-bytes", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument(
        "--read-all",
        action="store_true",
        help="where the model fits, deltafind reads every expert into its unlimited cache before "
        "timing (the whole model in memory, as llama.cpp's load holds the whole file; a long-running "
        "daemon's cache reaches this as real text routes to every expert), so no prefetch hint is "
        "computed; without it only the experts the greedy tokens route to are held",
    )
    a = ap.parse_args()
    if a.serve:
        a.threads = int(a.threads)
        serve(a)
        return
    a.root.mkdir(parents=True, exist_ok=True)
    a.gguf, a.store = (
        a.root / f"qwen3moe-30b-a3b-{a.layers}l-q4_k_m.gguf",
        a.root / f"store-{a.layers}l",
    )
    if not a.gguf.exists():
        t0 = time.perf_counter()
        make_gguf(a.gguf, a.layers)
        log(
            f"wrote {a.gguf} ({a.gguf.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t0:.0f} s"
        )
    if not (a.store / "manifest.json").exists():
        t0 = time.perf_counter()
        make_store(a.gguf, a.store)
        log(f"imported {a.store} in {time.perf_counter() - t0:.0f} s")
    size = a.gguf.stat().st_size
    import random

    rng = random.Random(0)
    prompt = [rng.randrange(256) for _ in range(8)]
    long_prompt = [rng.randrange(256) for _ in range(a.prefill_tokens)]
    only = set(a.only.split(","))
    maths = a.math.split(",")
    if not set(maths) <= {"exact", "bf16", "q8"}:
        sys.exit(f"--math takes exact, bf16 and q8 (got {a.math!r})")
    result: dict = {
        "bench": "moe_vs_llamacpp",
        "gguf_bytes": size,
        "layers": a.layers,
        "new_tokens": a.new_tokens,
        "rounds": a.rounds,
        "loadavg_start": [round(v, 2) for v in os.getloadavg()],
        "math": maths,
    }
    settings = None
    for threads in [int(t) for t in a.threads.split(",")] if "decode" in only else []:
        workers = [Worker("llamacpp", a, threads, None, None)] + [
            Worker(deltafind_name(m), a, threads, None, None) for m in maths
        ]
        settings = workers[0].info["settings"]
        result[f"decode_{threads}t"] = decode_rounds(
            workers, prompt, a.new_tokens, a.rounds, f"{threads}t"
        )
        for w in workers:
            w.close()
    if "prefill" in only:
        workers = [Worker("llamacpp", a, a.prefill_threads, None, None)] + [
            Worker(deltafind_name(m), a, a.prefill_threads, None, None) for m in maths
        ]
        settings = workers[0].info["settings"]
        result[f"prefill_{a.prefill_tokens}_{a.prefill_threads}t"] = prefill_rounds(
            workers, long_prompt, a.prefill_rounds
        )
        for w in workers:
            w.close()
    if "cap" in only:
        cap = int(size * a.cap_fraction)
        cache = int(cap * a.cap_cache_fraction)
        drop_from_page_cache([a.gguf, *(p for p in a.store.rglob("*") if p.is_file())])
        groups = {name: memory_cgroup(f"dfbench-{name}", cap) for name in ("llamacpp", "deltafind")}
        result["capped"] = {
            "cap_bytes": cap,
            "deltafind_expert_cache_bytes": cache,
            "threads": a.cap_threads,
            "new_tokens": a.cap_new_tokens,
        }
        try:  # llama.cpp at its defaults repacks K-quants into anonymous memory: under the cap it may not load
            w = Worker("llamacpp", a, a.cap_threads, None, groups["llamacpp"])
            w.gen(prompt, 2)
            w.close()
            result["capped"]["llamacpp_defaults"] = "ran"
        except WorkerDied as e:
            log(f"capped llama.cpp at its defaults: {e}")
            result["capped"]["llamacpp_defaults"] = str(e)
        drop_from_page_cache([a.gguf])
        workers = [
            Worker("llamacpp_norepack", a, a.cap_threads, None, groups["llamacpp"]),
            Worker("deltafind", a, a.cap_threads, cache, groups["deltafind"]),
        ]
        result["capped"]["llamacpp_norepack_settings"] = workers[0].info["settings"]
        result["capped"]["temperature"] = a.cap_temperature
        result["capped"].update(
            decode_rounds(workers, prompt, a.cap_new_tokens, a.rounds, "capped", a.cap_temperature)
        )
        for w in workers:
            w.close()
        for g in groups.values():
            with contextlib.suppress(OSError):
                g.rmdir()
    if maths != ["exact"]:
        result.update(
            logit_drift(a.store, maths, a.drift_tokens, max(int(a.threads.split(",")[-1]), 1))
        )
    import llama_cpp
    import torch

    result.update(
        {
            "llamacpp_settings": settings,
            "llama_cpp_python": llama_cpp.__version__,
            "torch": torch.__version__,
            "loadavg_end": [round(v, 2) for v in os.getloadavg()],
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "method": "(n_new-1)/(t_gen(n_new)-t_gen(1)), median over rounds, first engine alternated, EOS ignored",
        }
    )
    log(f"llama.cpp settings: {settings}")
    print(json.dumps(result, separators=(",", ":")))


if __name__ == "__main__":
    main()
