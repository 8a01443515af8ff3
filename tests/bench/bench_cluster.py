"""Cluster bench: decode speed vs expert nodes with every drive capped, wire bytes, exchange latency.

Each machine's drive is capped at --read-mb-s (`[[drives]] read_mb_s`) and caches no expert, so a
token's reads bound its time; one machine reads every routed expert itself, N nodes split them.
Configurations alternate round by round (one machine, then 1..N nodes), so load hits them alike;
the coordinator runs here, the nodes are `deltafind node` processes on loopback (gloo).
Prints one JSON line per configuration and round, then a summary:

  speedup      decode tok/s of N nodes / one machine's (goal >= 0.8 N, up to 4)
  wire         bytes per decoded token on the wire, against the expected formula (see its docstring)
               (per MoE layer: the routed hidden row once, k expert outputs back, fp32)
  exchange     per routed layer, send to last reply, with warm node caches and no cap (loopback)

  busiest      bytes the busiest node read per token; one machine's bytes / that = the speed-up the capped
               drives allow (drive bound); CPU seconds per token of each process and cores kept busy

    python tests/bench/bench_cluster.py --root /tmp/dfcluster [--nodes 1,2,3,4] [--read-mb-s 0.25] [--rounds 2]
        [--hot-replicas 0,0.25,1] [--no-pin-dense] [--no-exchange]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PROMPT = [11, 42, 7, 99, 13, 5, 64, 30]


def make_store(root: Path, family: str) -> Path:
    store = root / f"{family}-store"
    if not (store / "manifest.json").exists():
        exe = Path(sys.executable).with_name("deltafind")
        subprocess.run(
            [
                str(exe),
                "setup",
                "--synthetic",
                family,
                "--shape",
                "tiny",
                "--store",
                str(store),
                "--quiet",
                "--dense-slices",
                "2",
            ],
            check=True,
        )
    return store


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_config(store: Path, read_mb_s: float | None, cache: str) -> Path:
    path = store.parent / f"node-{read_mb_s}-{cache}.toml"
    cap = f"read_mb_s = {read_mb_s}\n" if read_mb_s else ""
    path.write_text(
        f'[model]\nstore = "{store}"\n\n[[drives]]\npath = "{store / "drive0"}"\n{cap}\n'
        f'[cache]\nexpert_bytes = "{cache}"\n\n[logging]\nlevel = "warning"\n'
    )
    return path


def open_model(
    store: Path,
    nodes: int,
    port: int,
    read_mb_s: float | None,
    cache: str,
    hot_replicas: float = 0.0,
) -> Any:
    from deltafind.api import Model
    from deltafind.config import load_settings

    drive = {"path": str(store / "drive0"), **({"read_mb_s": read_mb_s} if read_mb_s else {})}
    cluster = (
        {
            "role": "coordinator",
            "world_size": nodes + 1,
            "port": port,
            "join_timeout_s": 300,
            "hot_replicas": hot_replicas,
        }
        if nodes
        else {}
    )
    settings = load_settings(
        None,
        {
            "model": {"store": str(store)},
            "draft": {"mode": "off"},
            "drives": [drive],
            "cache": {"expert_bytes": cache},
            "logging": {"level": "warning"},
            "cluster": cluster,
        },
    )
    return Model.open(store, settings=settings)


def start_nodes(store: Path, nodes: int, port: int, config: Path) -> list[subprocess.Popen[bytes]]:
    exe = Path(sys.executable).with_name("deltafind")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return [
        subprocess.Popen(
            [
                str(exe),
                "node",
                "--config",
                str(config),
                "--rank",
                str(r),
                "--world-size",
                str(nodes + 1),
                "--cluster-port",
                str(port),
            ],
            env=env,
            stdout=subprocess.DEVNULL,
        )
        for r in range(1, nodes + 1)
    ]


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sample(model: Any, procs: list[subprocess.Popen[bytes]]) -> dict:
    """What the decode window is measured with: time, wire bytes, bytes each machine read, CPU of each process."""
    snap = model.snapshot()
    nodes = snap.get("nodes", [])
    return {
        "t": time.perf_counter(),
        "wire": sum(n["bytes_sent"] + n["bytes_received"] for n in nodes),
        "read": [n["bytes_read"] for n in nodes] or [snap["bytes_read"]],
        "cpu": [time.process_time()] + [cpu_s(p.pid) for p in procs],
    }


def measure(
    store: Path,
    nodes: int,
    read_mb_s: float | None,
    cache: str,
    new_tokens: int,
    pin_dense: bool,
    hot_replicas: float = 0.0,
) -> dict:
    """Decode figures (a generate of 1 token subtracted from one of `new_tokens`: prefill cancels): tok/s, wire
    bytes, bytes read by the busiest machine and all, CPU seconds of the coordinator and of each node, per token."""
    port = free_port()
    procs = start_nodes(store, nodes, port, node_config(store, read_mb_s, cache)) if nodes else []
    try:
        model = open_model(store, nodes, port, read_mb_s, cache, hot_replicas)
        try:
            if pin_dense:  # dense slices are read every token: a deployment keeps them resident, as it does the spine
                from deltafind.cluster.runs import routed_counts

                routed = routed_counts(model.manifest)
                model.experts.resident.pin(
                    [r.key for r in model.manifest.experts if r.layer not in routed], 1 << 40
                )
            model.generate(PROMPT, max_new_tokens=2)  # warm-up: first-use costs out of the figures
            s0 = sample(model, procs)
            model.generate(PROMPT, max_new_tokens=1)
            s1 = sample(model, procs)
            out = model.generate(PROMPT, max_new_tokens=new_tokens)
            s2 = sample(model, procs)
            decoded = len(out) - 1
            st = model.snapshot().get("nodes", [])
            layers = sum(n["layers"] for n in st)
            exchange = sum(n["exchange_s"] for n in st) / layers if layers else 0.0
            routed = len(model.cluster.routed) if model.cluster is not None else 0
            args = model.manifest.model_config
        finally:
            model.close()
    finally:
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGKILL)
                p.wait()

    def per_token(
        key: str,
    ) -> list[float]:  # the decode window's share: (s2 - s1) - (s1 - s0), per decoded token
        return [
            ((c - b) - (b - a)) / max(decoded, 1)
            for a, b, c in zip(s0[key], s1[key], s2[key], strict=True)
        ]

    decode_s = (s2["t"] - s1["t"]) - (s1["t"] - s0["t"])
    read = per_token("read")
    cpu = per_token("cpu")
    return {
        "nodes": nodes,
        "hot_replicas": hot_replicas,
        "read_mb_s": read_mb_s,
        "tokens": decoded,
        "decode_tok_s": decoded / decode_s if decode_s > 0 else 0.0,
        "wire_bytes_per_token": ((s2["wire"] - s1["wire"]) - (s1["wire"] - s0["wire"])) / decoded
        if decoded
        else 0.0,
        "exchange_ms_per_layer": 1e3 * exchange,
        "busiest_read_per_token": max(read),
        "read_per_token": sum(read),
        "cpu_s_per_token": cpu,
        "cores_busy": sum(cpu) * decoded / decode_s if decode_s > 0 else 0.0,
        "routed_layers": routed,
        "config": args,
        "load": os.getloadavg(),
    }


def formula_bytes(result: dict) -> float:
    """The issue's wire formula per token: per routed layer, the routed row once plus k outputs, fp32."""
    cfg = result["config"].get("text_config", result["config"])
    width = cfg.get("routed_expert_hidden_size") or cfg["hidden_size"]
    k = cfg.get("num_experts_per_tok") or cfg.get("num_experts_per_token")
    return result["routed_layers"] * 4 * width * (1 + k)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--root", type=Path, default=Path("/tmp/dfcluster"))
    ap.add_argument(
        "--family",
        default="kimi_k3",
        help="synthetic family of the tiny store (kimi_k3, qwen3_moe)",
    )
    ap.add_argument("--nodes", default="1,2,3,4")
    ap.add_argument("--read-mb-s", type=float, default=0.25, help="each machine's drive cap")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--hot-replicas",
        default="0",
        help="[cluster] hot_replicas, one or more separated by commas: that "
        "fraction of each layer's hottest experts on two nodes (1 = every expert twice), each read sent to "
        "the less loaded copy",
    )
    ap.add_argument(
        "--pin-dense",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep the dense layers' slices resident on the machine computing them (default on)",
    )
    ap.add_argument(
        "--exchange",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure the exchange with warm caches and no cap (2 nodes)",
    )
    args = ap.parse_args()
    args.root.mkdir(parents=True, exist_ok=True)
    store = make_store(args.root, args.family)
    counts = [int(n) for n in args.nodes.split(",")]
    hots = [float(h) for h in args.hot_replicas.split(",")]
    configs = [(0, 0.0)] + [
        (n, h) for h in hots for n in counts
    ]  # (nodes, hot_replicas); 0 nodes: one machine
    runs: dict[tuple[int, float], list[dict]] = {c: [] for c in configs}
    for rnd in range(args.rounds):
        for (
            n,
            h,
        ) in configs:  # alternating within each round, so load hits every configuration alike
            r = measure(store, n, args.read_mb_s, "0", args.new_tokens, args.pin_dense, h)
            runs[(n, h)].append(r)
            print(
                json.dumps(
                    {
                        "bench": "cluster_decode",
                        "round": rnd,
                        **{k: v for k, v in r.items() if k != "config"},
                    }
                ),
                flush=True,
            )
    if args.exchange:
        warm = measure(store, 2, None, "1GiB", args.new_tokens, args.pin_dense)
        print(
            json.dumps(
                {"bench": "cluster_exchange", **{k: v for k, v in warm.items() if k != "config"}}
            ),
            flush=True,
        )

    def med(c: tuple[int, float], key: str) -> float:
        return statistics.median(r[key] for r in runs[c])

    one, one_read = med((0, 0.0), "decode_tok_s"), med((0, 0.0), "read_per_token")
    print(
        f"\none machine (drive {args.read_mb_s} MB/s, no expert cache, dense slices {'pinned' if args.pin_dense else 'read'}): "
        f"{one:.2f} tok/s, reads {one_read / 1e3:.1f} kB/token, CPU {med((0, 0.0), 'cores_busy'):.2f} cores; "
        f"load {os.getloadavg()}"
    )
    for n, h in configs[1:]:
        c = (n, h)
        tok, wire, busiest = (
            med(c, "decode_tok_s"),
            med(c, "wire_bytes_per_token"),
            med(c, "busiest_read_per_token"),
        )
        cpu = [statistics.median(r["cpu_s_per_token"][i] for r in runs[c]) for i in range(n + 1)]
        f = formula_bytes(runs[c][0])
        print(
            f"{n} node(s), hot_replicas {h:g}: {tok:.2f} tok/s = {tok / one:.2f}x one machine (goal >= {0.8 * n:.1f}x); "
            f"busiest node reads {busiest / 1e3:.1f} kB/token (drive bound {one_read / busiest:.2f}x); "
            f"CPU s/token coordinator {cpu[0]:.3f}, nodes max {max(cpu[1:]):.3f}, all {med(c, 'cores_busy'):.2f} cores busy; "
            f"exchange {med(c, 'exchange_ms_per_layer'):.1f} ms/layer; wire {wire / 1e3:.1f} kB/token = {wire / f:.2f}x "
            f"the formula's {f / 1e3:.1f} kB"
        )
    if args.exchange:
        print(
            f"exchange per routed layer, 2 nodes, warm caches, no cap: {warm['exchange_ms_per_layer']:.2f} ms (loopback gloo)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
