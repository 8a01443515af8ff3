"""Turn-over-turn prefix reuse: a recorded 10-turn agent session replayed against the daemon.

The sessions are the real Claude Code and Codex CLIs' requests as their conversation grows (tool
calls, tool results, one request the CLI retried after an error), recorded by
tests/e2e/agent_session.py in tests/data/agents/session-{claude,codex}.json. Each is sent again as
recorded (max_tokens cut, greedy); the retried request goes twice, and the daemon is restarted before
turn --restart-at with [cache] prompt_disk_bytes on, so that turn's prefix can only come from the
files the first daemon wrote. Per request it prints the prompt tokens, the tokens the prefix cache
served, the tokens prefilled (prompt - cached) and the tokens new to the conversation (past the
longest prefix shared with the previous request's prompt, on the store's tokenizer). The recorded
answers are the CLI's (scripted), not the daemon's, so every turn's new tokens include the previous
answer. The floor is prefilled == new. The last line is one JSON object: the share of turn 2..10
prompt tokens served from the cache (goal >= 0.95) and the restart turn's cached tokens.

    python tests/bench/bench_agent_turns.py --store K3_STORE --cli claude|codex [--restart-at 7] [--max-tokens 16]
    python tests/bench/bench_agent_turns.py --store K3_STORE --split-cost   # expert reads a checkpoint's split costs

A synthetic K3 store: `deltafind setup --synthetic kimi_k3 --shape tiny --store K3_STORE`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `tests.` below, run as a script
from deltafind.server.chat_plan import plan_chat
from deltafind.server.openai import chat_messages
from deltafind.server.schemas import ChatRequest
from deltafind.tokenizer import Tokenizer
from tests.e2e.agent_session import main_requests, prompt_ids
from tests.e2e.daemon_fixtures import Daemon

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the project",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "maxLength": 40}},
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run the test suite",
            "parameters": {
                "type": "object",
                "properties": {"k": {"type": "string", "maxLength": 20}},
            },
        },
    },
]


def split_cost(store: Path) -> None:
    """Expert reads of turn 1's prefill in one chunk vs split at the history end (what a checkpoint costs;
    the copy itself reads nothing), the expert cache off so every use is a read."""
    import torch

    from deltafind import Model
    from deltafind.models.ops.batch import SequenceCache, forward_step

    m = Model.open(store, expert_bytes=0, prefetch=False)
    body = ChatRequest(
        model="x",
        messages=[
            {"role": "system", "content": "You are a coding agent. Use the tools."},
            {"role": "user", "content": "Find out why test_parse fails."},
        ],
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        chat_template_kwargs={"thinking": False},
    )
    plan = plan_chat(m.tokenizer, body, chat_messages(body))
    ids, h = plan.prompt_ids, plan.history_end

    def reads(chunks: list[list[int]]) -> int:
        r0, cache = m.experts.stats.requested, SequenceCache(m.net.num_layers)
        with torch.inference_mode():
            for chunk in chunks:
                forward_step(m.net, cache, chunk)
        return m.experts.stats.requested - r0

    one, split = reads([ids]), reads([ids[:h], ids[h:]])
    print(
        json.dumps(
            {
                "prompt": len(ids),
                "history_end": h,
                "expert_reads_one_chunk": one,
                "expert_reads_split": split,
            }
        )
    )
    m.close()


def _send(d: Daemon, cli: str, rec: dict, max_tokens: int) -> tuple[int, int]:
    """(prompt tokens, cached tokens) of one recorded request sent again, non-streamed and greedy."""
    body = {**rec["body"], "stream": False, "temperature": 0}
    body["max_tokens" if cli == "claude" else "max_output_tokens"] = max_tokens
    headers = {
        k: v
        for k, v in rec["headers"].items()
        if k.startswith(("anthropic-", "x-", "content-type", "originator", "session"))
    }
    status, raw = d.request(
        "POST",
        rec["path"],
        json.dumps(body).encode(),
        {**headers, "content-type": "application/json"},
        timeout=3600,
    )
    out = json.loads(raw)
    assert status == 200, (status, out)
    u = out["usage"]
    if cli == "claude":
        return u["input_tokens"] + u["cache_read_input_tokens"], u["cache_read_input_tokens"]
    return u["input_tokens"], u["input_tokens_details"]["cached_tokens"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", type=Path, required=True)
    ap.add_argument("--cli", choices=["claude", "codex"], default="claude")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument(
        "--restart-at",
        type=int,
        default=7,
        help="restart the daemon before this turn, prompt state on disk (0: none)",
    )
    ap.add_argument("--config", default="", help="more daemon config (TOML lines)")
    ap.add_argument(
        "--split-cost",
        action="store_true",
        help="only the expert reads a checkpoint's split chunk costs (K3)",
    )
    args = ap.parse_args()
    if args.split_cost:
        split_cost(args.store)
        return
    reqs = main_requests(args.cli)
    tok = Tokenizer.load(args.store / "tokenizer")
    folder = Path(tempfile.mkdtemp(prefix="dfd-prompts-"))
    config = (
        f'[server]\nmax_running = 1\n[cache]\nprompt_disk_bytes = "4GiB"\nprompt_disk_dir = "{folder}"\n'
        + args.config.replace("\\n", "\n")
    )
    d = Daemon(args.store, config).start(timeout=600)
    rows: list[dict] = []
    try:
        prev: list[int] | None = None
        turn = 0
        print(
            f"{'turn':>4} {'prompt':>7} {'cached':>7} {'prefilled':>9} {'new':>6} {'seconds':>7}  note"
        )
        for rec in reqs:
            ids = prompt_ids(tok, args.cli, rec["body"])
            retry = prev is not None and ids == prev
            turn += 0 if retry else 1
            note = "retry" if retry else ""
            if turn == args.restart_at and not retry and not any(r["turn"] == turn for r in rows):
                d.stop()
                d.cleanup()
                d = Daemon(args.store, config).start(timeout=600)
                note = "after a restart"
            t0 = time.monotonic()
            prompt, cached = _send(d, args.cli, rec, args.max_tokens)
            seconds = time.monotonic() - t0
            assert prompt == len(ids), (prompt, len(ids))
            shared = (
                0
                if prev is None
                else next(
                    (k for k, (a, b) in enumerate(zip(prev, ids, strict=False)) if a != b),
                    min(len(prev), len(ids)),
                )
            )
            new = len(ids) - shared
            print(
                f"{turn:>4} {prompt:>7} {cached:>7} {prompt - cached:>9} {new:>6} {seconds:>7.1f}  {note}"
            )
            rows.append(
                {
                    "turn": turn,
                    "prompt": prompt,
                    "cached": cached,
                    "new": new,
                    "note": note,
                    "seconds": round(seconds, 1),
                }
            )
            prev = ids
        later = [r for r in rows if r["turn"] > 1]
        restart = next((r for r in rows if r["note"] == "after a restart"), None)
        print(
            json.dumps(
                {
                    "cli": args.cli,
                    "turns": turn,
                    "requests": len(rows),
                    "restart_at": args.restart_at or None,
                    "restart_turn_prompt": restart and restart["prompt"],
                    "restart_turn_cached": restart and restart["cached"],
                    "prefilled_over_new_turns_2_on": round(
                        sum(r["prompt"] - r["cached"] for r in later)
                        / max(sum(r["new"] for r in later), 1),
                        4,
                    ),
                    "cached_share_turns_2_on": round(
                        sum(r["cached"] for r in later) / max(sum(r["prompt"] for r in later), 1), 4
                    ),
                }
            )
        )
    finally:
        d.stop()
        d.cleanup()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
