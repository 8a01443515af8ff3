"""Record a 10-turn agent session of the real Claude Code and Codex CLIs (tests/data/agents/session-*.json).

A synthetic K3 store has random weights and never writes a tool call, so the proxy plays the model's
side of the main conversation from a script (tool calls, one error the CLI retries, a closing answer);
everything else the CLI sends goes to the daemon. The CLI runs its tools for real on a small project,
so each recorded request is what it sends as its conversation grows. tests/bench/bench_agent_turns.py
replays them. `python -m tests.e2e.agent_session STORE claude|codex`.
"""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.e2e.agent_proxy import FIXTURES, Reply

PROJECT = {
    "calc.py": "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n",
    "test_calc.py": "from calc import add, mul\n\nassert add(2, 3) == 5, add(2, 3)\nassert mul(2, 3) == 6\nprint('ok')\n",
    "README.md": "# calc\n\nA tiny calculator. Run `python3 test_calc.py`.\n",
}
PROMPT = "test_calc.py fails. Find out why and fix calc.py, then run the test again."
RETRY_AT = 5  # the main request answered once with an overload error, which the CLI retries
SSE = {"Content-Type": "text/event-stream"}


def _sse(events: list[tuple[str, dict[str, Any]]]) -> bytes:
    return b"".join(
        f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode() for kind, data in events
    )


# -- Claude Code (Anthropic Messages) --------------------------------------------------------------------


def claude_steps(work: Path) -> list[tuple[str, dict[str, Any]] | str]:
    """The model's side: (tool name, input) per turn, and the closing text."""
    return [
        ("Bash", {"command": "ls", "description": "List the project files"}),
        ("Read", {"file_path": str(work / "test_calc.py")}),
        ("Bash", {"command": "python3 test_calc.py", "description": "Run the failing test"}),
        ("Read", {"file_path": str(work / "calc.py")}),
        (
            "Edit",
            {
                "file_path": str(work / "calc.py"),
                "old_string": "return a - b",
                "new_string": "return a + b",
            },
        ),
        ("Bash", {"command": "python3 test_calc.py", "description": "Run the test again"}),
        ("Read", {"file_path": str(work / "README.md")}),
        ("Bash", {"command": "cat calc.py", "description": "Show the fixed file"}),
        ("Bash", {"command": "ls -la", "description": "Check nothing else changed"}),
        "Fixed: `add` subtracted; it now returns a + b and test_calc.py prints ok.",
    ]


def _message(content: list[tuple[str, dict[str, Any]]], stop: str, n: int) -> bytes:
    # one id per message: Claude Code merges the blocks of messages that share one
    start = {
        "type": "message_start",
        "message": {
            "id": f"msg_scripted_{n:02d}",
            "type": "message",
            "role": "assistant",
            "model": "test-model",
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 1, "output_tokens": 1},
        },
    }
    events: list[tuple[str, dict[str, Any]]] = [("message_start", start)]
    for i, (kind, value) in enumerate(content):
        if kind == "text":
            events += [
                (
                    "content_block_start",
                    {
                        "type": "content_block_start",
                        "index": i,
                        "content_block": {"type": "text", "text": ""},
                    },
                ),
                (
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": i,
                        "delta": {"type": "text_delta", "text": value["text"]},
                    },
                ),
            ]
        else:
            block = {"type": "tool_use", "id": value["id"], "name": value["name"], "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(value["input"])}
            events += [
                (
                    "content_block_start",
                    {"type": "content_block_start", "index": i, "content_block": block},
                ),
                (
                    "content_block_delta",
                    {"type": "content_block_delta", "index": i, "delta": delta},
                ),
            ]
        events.append(("content_block_stop", {"type": "content_block_stop", "index": i}))
    events += [
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop, "stop_sequence": None},
                "usage": {"output_tokens": 20},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]
    return _sse(events)


def claude_script(work: Path) -> Callable[[dict[str, Any]], Reply | None]:
    steps, seen, ids = claude_steps(work), [], itertools.count(1)

    def answer(rec: dict[str, Any]) -> Reply | None:
        body = rec.get("body")
        if (
            rec["method"] != "POST"
            or not rec["path"].startswith("/v1/messages?")
            or not isinstance(body, dict)
            or not body.get("tools")
        ):
            return None  # not the main conversation: the daemon answers
        seen.append(rec)
        if len(seen) == RETRY_AT:
            return (
                529,
                {"Content-Type": "application/json"},
                json.dumps(
                    {
                        "type": "error",
                        "error": {
                            "type": "overloaded_error",
                            "message": "Overloaded (scripted: the CLI retries)",
                        },
                    }
                ).encode(),
            )
        turn = len(seen) - (len(seen) > RETRY_AT) - 1
        step = steps[min(turn, len(steps) - 1)]
        if isinstance(step, str):
            return 200, SSE, _message([("text", {"text": step})], "end_turn", turn)
        name, args = step
        return (
            200,
            SSE,
            _message(
                [
                    ("text", {"text": "Let me check."}),
                    ("tool_use", {"id": f"toolu_{next(ids):02d}", "name": name, "input": args}),
                ],
                "tool_use",
                turn,
            ),
        )

    return answer


# -- Codex (OpenAI Responses) ---------------------------------------------------------------------------


CODEX_STEPS: list[str] = [
    "ls",
    "cat test_calc.py",
    "python3 test_calc.py",
    "cat calc.py",
    "grep -n 'a - b' calc.py",
    "sed -n 1,3p calc.py",
    "cat README.md",
    "python3 -c 'import calc; print(calc.add(2, 3))'",
    "ls -la",
]
CODEX_DONE = "add() subtracts instead of adding: change `return a - b` to `return a + b` in calc.py (the sandbox is read-only)."


def _response(item: dict[str, Any]) -> bytes:
    resp = {
        "id": "resp_scripted",
        "object": "response",
        "status": "in_progress",
        "model": "test-model",
        "output": [],
    }
    done = {
        **resp,
        "status": "completed",
        "output": [item],
        "usage": {
            "input_tokens": 1,
            "output_tokens": 20,
            "total_tokens": 21,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0},
        },
    }
    events = [
        ("response.created", {"response": resp}),
        ("response.in_progress", {"response": resp}),
        (
            "response.output_item.added",
            {"output_index": 0, "item": {**item, "status": "in_progress"}},
        ),
    ]
    if item["type"] == "message":
        text = item["content"][0]["text"]
        events += [
            (
                "response.output_text.delta",
                {"output_index": 0, "item_id": item["id"], "content_index": 0, "delta": text},
            ),
            (
                "response.output_text.done",
                {"output_index": 0, "item_id": item["id"], "content_index": 0, "text": text},
            ),
        ]
    else:
        events += [
            (
                "response.function_call_arguments.done",
                {"output_index": 0, "item_id": item["id"], "arguments": item["arguments"]},
            )
        ]
    events += [
        ("response.output_item.done", {"output_index": 0, "item": item}),
        ("response.completed", {"response": done}),
    ]
    return _sse([(k, {"type": k, "sequence_number": i, **d}) for i, (k, d) in enumerate(events)])


def codex_script(work: Path) -> Callable[[dict[str, Any]], Reply | None]:
    seen: list[dict[str, Any]] = []

    def answer(rec: dict[str, Any]) -> Reply | None:
        body = rec.get("body")
        if (
            rec["method"] != "POST"
            or not rec["path"].startswith("/v1/responses")
            or not isinstance(body, dict)
            or not body.get("tools")
        ):
            return None
        seen.append(rec)
        if len(seen) == RETRY_AT:
            return (
                500,
                {"Content-Type": "application/json"},
                json.dumps(
                    {
                        "error": {
                            "type": "server_error",
                            "message": "scripted: the CLI retries",
                            "code": None,
                            "param": None,
                        }
                    }
                ).encode(),
            )
        turn = len(seen) - (len(seen) > RETRY_AT) - 1
        if turn >= len(CODEX_STEPS):
            item = {
                "type": "message",
                "id": "msg_scripted",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": CODEX_DONE, "annotations": []}],
            }
        else:
            item = {
                "type": "function_call",
                "id": f"fc_{turn:02d}",
                "call_id": f"call_{turn:02d}",
                "name": "exec_command",
                "arguments": json.dumps({"cmd": CODEX_STEPS[turn]}),
                "status": "completed",
            }
        return 200, SSE, _response(item)

    return answer


def main_requests(cli: str) -> list[dict[str, Any]]:
    """A recorded session's main-conversation requests, in order (those the script answered; the retried one twice)."""
    recs = json.loads((FIXTURES / f"session-{cli}.json").read_text())["requests"]
    path = "/v1/messages" if cli == "claude" else "/v1/responses"
    return [
        r
        for r in recs
        if r["method"] == "POST"
        and r["path"].startswith(path)
        and isinstance(r["body"], dict)
        and r["body"].get("tools")
    ]


def prompt_ids(tok: Any, cli: str, body: dict[str, Any]) -> list[int]:
    """The prompt the daemon renders for a recorded `body` (before server/turns.py's re-spelling, which keeps its text)."""
    from deltafind.server.chat_plan import plan_chat
    from deltafind.server.messages_request import to_chat as messages_to_chat
    from deltafind.server.openai import chat_messages
    from deltafind.server.responses_input import to_chat as responses_to_chat
    from deltafind.server.schemas import parse_body

    chat = parse_body(
        messages_to_chat(body) if cli == "claude" else responses_to_chat(body, []), chat=True
    )
    return plan_chat(tok, chat, chat_messages(chat), True).prompt_ids


def main() -> None:
    from tests.e2e.daemon_fixtures import Daemon

    store, cli = Path(sys.argv[1]), sys.argv[2]
    d = Daemon(store, "[server]\nmax_running = 1\n").start(timeout=600)
    try:
        if cli == "claude":
            from tests.e2e.claude_cli import CLAUDE_VERSION, SHORT, claude_bin, redact, run_claude

            exe = claude_bin()
            assert exe is not None, "node/npm missing"
            args = [
                "--tools",
                "Bash,Read,Edit",
                "--allowedTools",
                "Bash,Read,Edit",
                "--max-turns",
                "20",
            ]
            run = run_claude(
                exe,
                d.port,
                "test-model",
                PROMPT,
                *args,
                timeout=900,
                max_output_tokens=SHORT,
                files=PROJECT,
                script=claude_script,
            )
            meta = {
                "cli": f"@anthropic-ai/claude-code@{CLAUDE_VERSION}",
                "args": ["-p", PROMPT, *args],
            }
            records = [redact(r) for r in run.records]
            out = run.stdout
        else:
            from tests.e2e.codex_cli import CODEX_VERSION, codex_bin, run_codex

            exe = codex_bin()
            assert exe is not None, "node/npm missing"
            run = run_codex(
                exe,
                d.port,
                "test-model",
                PROMPT,
                timeout=900,
                retries=2,
                files=PROJECT,
                script=codex_script,
            )
            meta = {"cli": f"@openai/codex@{CODEX_VERSION}", "args": ["exec", PROMPT]}
            records, out = run.records, run.answer
    finally:
        d.stop()
    print("rc", run.returncode, "answer", repr(out[:300]))
    print(run.stderr[-3000:])
    path = FIXTURES / f"session-{cli}.json"
    path.write_text(
        json.dumps(
            {**meta, "script": "tests/e2e/agent_session.py", "requests": records},
            indent=1,
            ensure_ascii=False,
        )
        + "\n"
    )
    print("wrote", path, [(r["method"], r["path"], r.get("status")) for r in records])
    print(d.log_text()[-2000:])


if __name__ == "__main__":
    main()
