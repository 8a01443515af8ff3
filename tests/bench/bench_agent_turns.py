"""Turn-over-turn prefix reuse: a scripted 6-turn tool-using conversation replayed against the daemon.

Per turn it prints the prompt tokens, the tokens the prefix cache served, the tokens prefilled
(prompt - cached) and the tokens that turn added to the conversation (prompt - previous prompt -
previous completion). Goal: prefilled == new + 1 (the previous turn's last token was sampled but
never run through the model, so it is prefilled with the new ones).

Kimi K3 renders tool_choice required/none as a system message after the history (docs/kimi-k3-format.md §6.6), so
its turns resume at the checkpoint where the previous history ended and run again what follows
it there: the previous answer (generated with that message in context) and the previous
per-request tail (that message and the generation prompt). Those are printed as "answer" and
"tail" (the tail from `plan_chat`'s history_end on the store's tokenizer); the floor is then
prefilled == new + answer + tail.

    python tests/bench/bench_agent_turns.py [--store ~/.cache/deltafind/demo] [--no-thinking] [--max-tokens N]
    python tests/bench/bench_agent_turns.py --store K3_STORE --split-cost   # expert reads a checkpoint's split costs
    python tests/bench/bench_agent_turns.py --store K3_STORE --no-thinking --tool-choice auto --retry-at 3 --restart-at 5

--retry-at N sends turn N twice (a client that timed out and retried; the retry is a turn of its own);
--restart-at N restarts the daemon before turn N, with [cache] prompt_disk_bytes on, so that turn's
prefix can only come from the files the first daemon wrote. The last line is one JSON object: the
share of turn 2..N prompt tokens served from the cache (goal >= 0.95) and the restart turn's cached tokens.

A synthetic K3 store (`deltafind setup --synthetic kimi_k3`) has random weights: it never closes its think
channel by itself, so replay it with --no-thinking (the call then starts at once, forced by the grammar).
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import openai

from deltafind.server.chat_plan import plan_chat
from deltafind.server.openai import chat_messages
from deltafind.server.schemas import ChatRequest
from deltafind.tokenizer import Tokenizer
from tests.e2e.daemon_fixtures import Daemon

TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file of the project",
                                           "parameters": {"type": "object", "properties": {"path": {"type": "string", "maxLength": 40}},
                                                          "required": ["path"]}}},
         {"type": "function", "function": {"name": "run_tests", "description": "Run the test suite",
                                           "parameters": {"type": "object", "properties": {"k": {"type": "string", "maxLength": 20}}}}}]
SCRIPT = ["Find out why test_parse fails.", None, None, "Now fix it.", None, "Summarise what you changed."]
RESULTS = {"read_file": "def parse(s):\n    return int(s)\n", "run_tests": "1 failed: test_parse (ValueError)"}


def split_cost(store: Path) -> None:
    """Expert reads of turn 1's prefill in one chunk vs split at the history end (what a checkpoint costs;
    the copy itself reads nothing), the expert cache off so every use is a read."""
    import torch

    from deltafind import Model
    from deltafind.engine.generate import forward_step
    from deltafind.models.ops.batch import SequenceCache

    m = Model.open(store, expert_cache_bytes=0, prefetch=False)
    body = ChatRequest(model="x", messages=[{"role": "system", "content": "You are a coding agent. Use the tools."},
                                            {"role": "user", "content": SCRIPT[0]}], tools=TOOLS, tool_choice="required",
                       parallel_tool_calls=False, chat_template_kwargs={"thinking": False})
    plan = plan_chat(m.tokenizer, body, chat_messages(body))
    ids, h = plan.prompt_ids, plan.history_end

    def reads(chunks: list[list[int]]) -> int:
        r0, cache = m.experts.stats.requested, SequenceCache(m.net.num_layers)
        with torch.inference_mode():
            for chunk in chunks:
                forward_step(m.net, cache, chunk)
        return m.experts.stats.requested - r0

    one, split = reads([ids]), reads([ids[:h], ids[h:]])
    print(json.dumps({"prompt": len(ids), "history_end": h, "expert_reads_one_chunk": one, "expert_reads_split": split}))
    m.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", type=Path, default=Path.home() / ".cache/deltafind/demo")
    ap.add_argument("--no-thinking", action="store_true", help="chat_template_kwargs thinking=false on every turn")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--tool-choice", default="required", choices=["required", "auto"],
                    help="turns 1-5 (turn 6 is none); K3 renders required/none as a system message after the history")
    ap.add_argument("--split-cost", action="store_true", help="only the expert reads a checkpoint's split chunk costs (K3)")
    ap.add_argument("--retry-at", type=int, default=0, help="send this turn twice (0: none)")
    ap.add_argument("--restart-at", type=int, default=0, help="restart the daemon before this turn, prompt state on disk (0: none)")
    args = ap.parse_args()
    if args.split_cost:
        split_cost(args.store)
        return
    extra = {"extra_body": {"chat_template_kwargs": {"thinking": False}}} if args.no_thinking else {}
    folder = Path(tempfile.mkdtemp(prefix="dfd-prompts-"))
    config = f'[server]\nmax_running = 1\n[cache]\nprompt_disk_bytes = "4GiB"\nprompt_disk_dir = "{folder}"\n'
    d = Daemon(args.store, config if args.restart_at else "[server]\nmax_running = 1\n").start()
    rows: list[tuple[int, int, int]] = []  # (turn, prompt, cached)
    restart_cached = None
    try:
        c = openai.OpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0, timeout=600)
        msgs: list[dict] = [{"role": "system", "content": "You are a coding agent. Use the tools."}]
        tok = Tokenizer.load(args.store / "tokenizer")
        prev = None
        print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'prefilled':>9} {'new':>5} {'answer':>6} {'tail':>5}  output")
        for turn, user in enumerate(SCRIPT, 1):
            if user is not None:
                msgs.append({"role": "user", "content": user})
            choice = args.tool_choice if turn < len(SCRIPT) else "none"
            req = dict(model="test-model", messages=msgs, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                       temperature=0, max_tokens=args.max_tokens)
            if turn == args.restart_at:
                d.stop()
                d.cleanup()
                d = Daemon(args.store, config).start()
                c = openai.OpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0, timeout=600)
            for _ in range(2 if turn == args.retry_at else 1):
                r = c.chat.completions.create(**req, **extra)
                got = r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0
                rows.append((turn, r.usage.prompt_tokens, got))
            if turn == args.restart_at:
                restart_cached = got
            body = ChatRequest(**req, **extra.get("extra_body", {}))
            history_end = plan_chat(tok, body, chat_messages(body)).history_end  # 0: nothing follows the history
            u, m = r.usage, r.choices[0].message
            cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
            new = u.prompt_tokens - (prev[0] + prev[1]) if prev else u.prompt_tokens
            # after a checkpoint the previous answer and the previous tail are run again (the floor)
            answer, tail = (prev[1], prev[0] - prev[2]) if prev and prev[2] else (0, 0)
            what = f"call {m.tool_calls[0].function.name}" if m.tool_calls else f"text {len(m.content or '')} chars"
            what += f" ({r.choices[0].finish_reason})"
            print(f"{turn:>4} {u.prompt_tokens:>7} {cached:>7} {u.prompt_tokens - cached:>9} {new:>5} {answer:>6} {tail:>5}  {what}")
            prev = (u.prompt_tokens, u.completion_tokens, history_end)
            msgs.append(m.model_dump(exclude_none=True))
            for call in m.tool_calls or []:
                msgs.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(RESULTS[call.function.name])})
        later = [(p, k) for t, p, k in rows if t > 1]
        print(json.dumps({"turns": len(SCRIPT), "requests": len(rows), "retry_at": args.retry_at or None,
                          "restart_at": args.restart_at or None, "restart_turn_prompt": next((p for t, p, _ in rows if t == args.restart_at), None),
                          "restart_turn_cached": restart_cached,
                          "cached_share_turns_2_on": round(sum(k for _, k in later) / max(sum(p for p, _ in later), 1), 4)}))
    finally:
        d.stop()
        d.cleanup()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
