"""Slow clients: /health latency with and without 100 connections trickling their headers.

Starts the real daemon (`deltafind serve`, whatever `deltafind` PYTHONPATH selects)
on a tiny synthetic store, then times GET /health alone, and again while 100
connections each send one header line every 0.3 s and never finish their head.
Prints one JSON line (milliseconds, the ratio loaded/alone, how the slow
connections ended) and a summary on stderr.

    python tests/bench/bench_slow_clients.py [--store DIR] [--clients 100] [--probes 20]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.e2e.daemon_fixtures import BIN, Daemon


def probe(d: Daemon, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.monotonic()
        try:
            d.request("GET", "/health", timeout=60)
            out.append(time.monotonic() - t0)
        except OSError:
            out.append(float("inf"))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--store", type=Path, help="store to serve (default: a fresh tiny synthetic llama store)"
    )
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--probes", type=int, default=20)
    args = ap.parse_args()
    store = args.store
    if store is None:
        store = Path(tempfile.mkdtemp(prefix="dfbench-")) / "store"
        subprocess.run(
            [
                str(BIN / "deltafind"),
                "setup",
                "--synthetic",
                "llama",
                "--shape",
                "tiny",
                "--store",
                str(store),
                "--quiet",
            ],
            check=True,
            capture_output=True,
        )
    d = Daemon(store).start(timeout=180)
    try:
        alone = probe(d, args.probes)
        conns = []
        for _ in range(args.clients):
            s = socket.create_connection(("127.0.0.1", d.port), timeout=60)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            conns.append(s)
        stop = threading.Event()

        def trickle() -> None:
            while not stop.wait(0.3):
                for s in conns:
                    with contextlib.suppress(OSError):
                        s.sendall(b"X-Slow: 1\r\n")

        threading.Thread(target=trickle, daemon=True).start()
        time.sleep(1.0)
        loaded = probe(d, args.probes)
        stop.set()
        ended = 0
        deadline = time.monotonic() + 15  # header_timeout_s is 10 by default
        for s in conns:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            with contextlib.suppress(OSError):
                ended += s.recv(64).startswith(b"HTTP/1.1 408")
            s.close()
    finally:
        d.stop()
        d.cleanup()
    ms = lambda xs: round(1000 * statistics.median(xs), 2)  # noqa: E731
    row = {
        "clients": args.clients,
        "health_ms_alone_p50": ms(alone),
        "health_ms_loaded_p50": ms(loaded),
        "health_ms_loaded_max": round(1000 * max(loaded), 2),
        "loaded_over_alone": round(statistics.median(loaded) / statistics.median(alone), 2),
        "slow_clients_answered_408": ended,
    }
    print(json.dumps(row))
    print(
        f"/health p50 {row['health_ms_alone_p50']} ms alone, {row['health_ms_loaded_p50']} ms (max "
        f"{row['health_ms_loaded_max']} ms) with {args.clients} slow-header clients; {ended} of them got 408",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
