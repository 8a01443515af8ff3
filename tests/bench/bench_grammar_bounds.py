"""What a `response_format` enum of N values costs: the grammar's admission (compile, start, forced opening:
`server/structured.Grammar`) in this process, then a whole request to the daemon, on the demo and on a
synthetic K3 store; time and peak RSS growth, one JSON line per store and N.

    python tests/bench/bench_grammar_bounds.py --store ~/.cache/deltafind/demo --store /tmp/k3 [--sizes 100,1000,10000,20000]

Peak RSS is reset (`/proc/PID/clear_refs`) before each measurement, so each figure is that step's own peak.
K3's template renders `response_format` into the prompt, so its request time is mostly that prompt's prefill.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.e2e.daemon_fixtures import Daemon


def worker_pid(daemon: Daemon) -> int:
    assert daemon.proc is not None
    children = Path(f"/proc/{daemon.proc.pid}/task/{daemon.proc.pid}/children").read_text().split()
    return int(children[0])


def status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def enum_schema(n: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    values = [
        f"value {i} " + "".join(rng.choice("abcdefghij klmnop") for _ in range(12))
        for i in range(n)
    ]
    return {"type": "object", "properties": {"v": {"enum": values}}, "required": ["v"]}


def admission(store: Path, n: int) -> dict:
    """Seconds and peak RSS growth (MiB) of admitting the enum's grammar, the vocabulary already built."""
    from deltafind.server.structured import Grammar, json_schema_grammar, vocabulary
    from deltafind.tokenizer import Tokenizer

    tok = Tokenizer.load(store / "tokenizer")
    vocabulary(tok)
    schema = enum_schema(n)
    Path("/proc/self/clear_refs").write_text("5")
    before = status_kib(os.getpid(), "VmRSS")
    t0 = time.perf_counter()
    try:
        Grammar(tok, json_schema_grammar(schema, "f"), "f")
        result = "admitted"
    except Exception as e:  # a refusal is a figure too
        result = str(e)[:160]
    return {
        "admit_s": round(time.perf_counter() - t0, 3),
        "admit_peak_growth_mib": round((status_kib(os.getpid(), "VmHWM") - before) / 1024, 1),
        "admit": result,
    }


def enum_body(n: int) -> dict:
    schema = enum_schema(n)
    return {
        "model": "test-model",
        "messages": [{"role": "user", "content": "Pick one."}],
        "max_tokens": 8,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "pick", "schema": schema},
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", action="append", required=True)
    ap.add_argument("--sizes", default="100,1000,10000,20000")
    ap.add_argument(
        "--timeout",
        type=float,
        default=300,
        help="seconds a request may take before it is reported as such",
    )
    args = ap.parse_args()
    for store in (Path(s).expanduser() for s in args.store):
        d = Daemon(store, '[server]\nmax_body_bytes = "64MiB"\n').start()
        try:
            pid = worker_pid(d)
            for n in (int(s) for s in args.sizes.split(",")):
                body = json.dumps(enum_body(n)).encode()
                Path(f"/proc/{pid}/clear_refs").write_text("5")  # peak RSS := current RSS
                before = status_kib(pid, "VmRSS")
                t0 = time.perf_counter()
                try:
                    status, raw = d.request(
                        "POST",
                        "/v1/chat/completions",
                        body,
                        {"Content-Type": "application/json"},
                        timeout=args.timeout,
                    )
                    answer = json.loads(raw)
                except TimeoutError:
                    status, answer = 0, {"error": {"message": f"no answer in {args.timeout} s"}}
                seconds = time.perf_counter() - t0
                peak = status_kib(pid, "VmHWM")
                print(
                    json.dumps(
                        {
                            "store": str(store),
                            "values": n,
                            "body_bytes": len(body),
                            **admission(store, n),
                            "status": status,
                            "request_s": round(seconds, 3),
                            "prompt_tokens": answer.get("usage", {}).get("prompt_tokens"),
                            "worker_rss_before_mib": round(before / 1024, 1),
                            "worker_peak_growth_mib": round((peak - before) / 1024, 1),
                            "result": (answer.get("error") or {}).get("message", "")[:160]
                            or answer["choices"][0]["message"]["content"][:60],
                        }
                    ),
                    flush=True,
                )
                # the worker is still busy with it: the next size would only queue behind
                if status == 0:
                    break
        finally:
            d.stop()
            d.cleanup()


if __name__ == "__main__":
    main()
