"""`deltafinctl`: status, reload, drain, resume, trace against a running daemon.

Prints a readable summary, or the reply as JSON with --json; exits 1 with a
clear message when no daemon answers or the daemon refuses (e.g. an invalid
config on reload), 4 when a permission keeps this user from the socket.
Global flags go before or after the subcommand.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from deltafind.errors import DeltafindError


def _global_options(p: argparse.ArgumentParser, default: object) -> None:
    p.add_argument(
        "--config",
        metavar="FILE",
        default=default,
        help="TOML config, for [control] socket (default /etc/deltafind/deltafind.toml)",
    )
    p.add_argument(
        "--socket",
        metavar="PATH",
        default=default,
        help="control socket (default: [control] socket)",
    )
    p.add_argument("--json", action="store_true", default=default, help="print the reply as JSON")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="deltafinctl",
        description="Control a running deltafind daemon over its control socket.",
    )
    _global_options(p, None)
    p.set_defaults(json=False)
    # The same flags after the subcommand too (`deltafinctl status --json`, as with systemctl and kubectl);
    # SUPPRESS keeps a subcommand from resetting what was given before it.
    after = argparse.ArgumentParser(add_help=False)
    _global_options(after, argparse.SUPPRESS)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser(
        "status", parents=[after], help="model, readiness, queue, tok/s, cache, drives, config"
    )
    sub.add_parser(
        "reload", parents=[after], help="re-read the config and apply what can change live"
    )
    d = sub.add_parser(
        "drain", parents=[after], help="stop taking new requests (running ones finish)"
    )
    d.add_argument(
        "--grace",
        type=float,
        default=0.0,
        metavar="S",
        help="cancel what still runs after S seconds (default: never)",
    )
    sub.add_parser("resume", parents=[after], help="take new requests again after drain")
    t = sub.add_parser(
        "trace", parents=[after], help="start or stop writing a router trace (JSONL)"
    )
    t.add_argument("action", choices=["start", "stop"])
    t.add_argument(
        "path",
        nargs="?",
        help="new trace file for start: a name, created in the daemon's [control] trace_dir "
        "(default trace-DATE-TIME.jsonl)",
    )
    return p


def _socket(args: argparse.Namespace) -> Path:
    if args.socket:
        return Path(args.socket)
    from deltafind.config import load_settings

    return Path(load_settings(args.config).control.socket)


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def store_lines(s: dict[str, Any]) -> list[str]:
    """The store snapshot (api.Model.snapshot) as text: `deltafinctl status` and `run --stats` both print it."""
    lines = [
        f"experts requested {s['cache_requested']}, read {s['experts_read']} ({_mib(s['bytes_read'])}), cache hits "
        f"{s['cache_hits']}, pinned hits {s['pinned_hits']} ({100 * s['cache_hit_rate']:.1f}%), cache {_mib(s['cache_used_bytes'])} "
        f"of {_mib(s['cache_budget_bytes'])} ({s.get('cache_experts', 0)} experts), pinned {_mib(s['pinned_bytes'])}, "
        f"dense layers held {s.get('dense_held_layers', 0)} ({_mib(s.get('dense_held_bytes', 0))})",
        f"prefetch   issued {s['prefetch_issued']}, used {s['prefetch_used']}, wasted {s['prefetch_wasted']}, "
        f"recall {100 * s['prefetch_recall']:.1f}%, io wait {s.get('io_wait_s', 0.0):.3f} s",
    ]
    if gate := s.get("prefetch_gate"):
        lines += prefetch_lines(gate)
    for d in s["drives"]:
        lines.append(
            f"drive {d['index']}    {'ok' if d['healthy'] else 'UNREADABLE'} {d['path']}: {d['reads']} reads, "
            f"{_mib(d['bytes_read'])}, {d['read_gb_s']:.2f} GB/s"
        )
    for n in s.get("nodes", ()):  # expert nodes of a cluster (deltafind/cluster)
        lines.append(
            f"node {n['rank']}     {'ok' if n['alive'] else 'DOWN'}: {n['experts']} experts, {n['experts_read']} read "
            f"({_mib(n['bytes_read'])}, {n['read_mb_s']:.1f} MB/s), {n['layers']} layers exchanged"
            + (f", last error: {n['last_error']}" if n["last_error"] else "")
        )
    if sp := s.get("spine"):
        lines.append(
            f"spine      {sp['resident_layers']} of {sp['num_layers']} layers resident, {sp['layer_reads']} layer "
            f"reads ({_mib(sp['bytes_read'])}), waited {sp['wait_s']:.3f} s"
        )
    if (k := s.get("cpu_kernels")) and not k["built"]:
        lines.append(f"kernels    {k['note']}")
    if s.get("spine_int8"):
        lines.append(
            "spine      row-int8 ([cache] spine_int8): NOT weight-exact, the logits drift from the released weights'"
        )
    if s.get("math", "exact") != "exact":  # math_note: fast_math.describe, what the mode computes
        lines.append(
            f"math       {s['math']} ([device] math): {s['math_note']}; the logits drift from exact fp32 "
            "(docs/math-modes.md)"
        )
    elif s.get("math_requested", "exact") != "exact":
        lines.append(f"math       exact: {s['math_note']}")
    if s.get("store_bytes_total") and s["store_bytes_present"] < s["store_bytes_total"]:
        lines.append(
            f"store      streaming install: {_mib(s['store_bytes_present'])} of {_mib(s['store_bytes_total'])} of experts on disk "
            f"({100 * s['store_bytes_present'] / s['store_bytes_total']:.1f}%); the rest is fetched on first use"
        )
    return lines


def prefetch_lines(gate: dict[str, Any]) -> list[str]:
    """The prefetch gate's per-layer recall and precision (and reads it started or held), eight layers a line."""
    cells = [
        f"{r['layer']}: r {100 * r['recall']:.0f}% p {100 * r['precision']:.0f}% ({r['issued']}/{r['issued'] + r['held']})"
        for r in gate["layers"]
        if r["predicted"] or r["needed"]
    ]
    return [
        f"prefetch   by layer, recall/precision (reads started/predicted) {'; '.join(cells[i : i + 8])}"
        for i in range(0, len(cells), 8)
    ] + (
        [
            f"prefetch   {gate['gated']} layer decisions started no read (no drive slack, window not yet timed, or precision under the threshold)"
        ]
        if gate.get("gated")
        else []
    )


def draft_line(source: str, mode: str, d: dict[str, Any]) -> str:
    """A draft's counters (DraftStats.as_dict) as one line of text."""
    return (
        f"draft {source} ({mode}): {d['accepted']} of {d['proposed']} proposed accepted "
        f"({100 * d['acceptance_rate']:.1f}%), {d['steps']} verify passes, saved ~{d['saved_s']:.2f} s"
        + (f", {d['failures']} failed" if d["failures"] else "")
    )


def summary(s: dict[str, Any]) -> str:
    state = "draining" if s["draining"] else s["load_status"]
    loaded = (
        time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(s["config_loaded_at"]))
        if s["config_loaded_at"]
        else "-"
    )
    lines = [
        f"model      {s['model']} ({state}), pid {s['pid']}, up {s['uptime_s']:.0f} s, deltafind {s['version']}"
    ]
    snap = s.get("snapshot") or {}
    if e := snap.get("engine"):  # none while the model loads
        lines.append(
            f"requests   {s['running']}/{s['max_running']} running, {s['waiting']} waiting (queue {s['max_queue']}), "
            f"{e['tok_s']:.1f} tok/s, {e['generated_tokens']} tokens in {e['steps']} steps"
        )
    if store := snap.get("store"):
        lines += store_lines(store)
    if e and e["draft_source"]:
        lines.append(draft_line(e["draft_source"], e["draft_mode"], e["draft"]))
    lines.append(f"config     {s['config_path'] or '(defaults)'}, loaded {loaded}")
    if s["restart_needed"]:
        lines.append(f"restart    needed for {', '.join(s['restart_needed'])}")
    trace = snap.get("trace") or {}
    if s["trace_path"]:
        lines.append(f"trace      writing {s['trace_path']}")
    elif trace.get("error"):
        lines.append(f"trace      stopped by a write error: {trace['error']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from deltafind.control import client
    from deltafind.control import control_pb2 as pb

    sock = _socket(args)
    if args.command == "status":
        reply = client.status(sock)
        text = summary(reply)
    elif args.command == "reload":
        reply = client.call(sock, "Reload", pb.ReloadRequest(), timeout=120)
        if not reply["ok"]:
            print(
                json.dumps(reply)
                if args.json
                else f"deltafinctl: reload refused, nothing changed:\n{reply['message']}",
                file=sys.stdout if args.json else sys.stderr,
            )
            return 1
        text = reply["message"] + (
            f"\napplied: {', '.join(reply['applied'])}" if reply["applied"] else "\nno live change"
        )
    elif args.command in ("drain", "resume"):
        reply = (
            client.call(sock, "Drain", pb.DrainRequest(grace_s=args.grace))
            if args.command == "drain"
            else client.call(sock, "Resume", pb.ResumeRequest())
        )
        text = f"{'draining' if reply['draining'] else 'serving'}: {reply['running']} running, {reply['waiting']} waiting"
    else:
        # a name is the daemon's to place (in its [control] trace_dir); a path is sent as given
        # (a stop's path is not read); start | stop are the enum's names
        action = pb.TraceRequest.Action.Value(args.action.upper())
        reply = client.call(sock, "Trace", pb.TraceRequest(action=action, path=args.path or ""))
        text = f"trace {'writing ' + reply['path'] if reply['active'] else 'stopped'}"
    print(json.dumps(reply) if args.json else text)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except DeltafindError as e:
        print(f"deltafinctl: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
