"""Claude Code against the real daemon: the fields it sends, its endpoints, its errors, its streams.

The anthropic SDK and raw HTTP drive a demo daemon with what Claude Code 2.1.197 sends (recorded
in tests/data/agents/claude-*.json by tests/e2e/claude_cli.py); where node is present, the real
CLI runs a session on a tiny synthetic K3 store (its 60k-token prompt: `slow`).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import jsonschema
import pytest

from deltafind.server.chat_plan import plan_chat
from deltafind.server.messages_request import to_chat
from deltafind.server.openai import chat_messages
from deltafind.server.schemas import parse_body
from deltafind.tokenizer import Tokenizer
from tests.conftest import deltafind_cmd
from tests.e2e.claude_cli import FIXTURES, SHORT, claude_bin, run_claude
from tests.e2e.daemon_fixtures import Daemon

CONFIG = "[server]\nmax_running = 1\n"  # one at a time: a second request waits in the queue (the ping test)
HELLO = [{"role": "user", "content": "Say hello."}]
JSON = {"Content-Type": "application/json"}
T0 = {"temperature": 0}


@pytest.fixture(scope="module")
def daemon(demo_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    # prompt state on a drive as well: the restart test's second session resumes from it (64 MiB: the CLI's short
    # prompts, ~46 KB a demo token, are written; the ping test's 2.4k-token ones are skipped)
    folder = tmp_path_factory.mktemp("prompts")
    d = Daemon(
        demo_store, CONFIG + f'[cache]\nprompt_disk_bytes = "64MiB"\nprompt_disk_dir = "{folder}"\n'
    ).start()
    yield d
    d.stop()
    d.cleanup()


@pytest.fixture(scope="module")
def sdk(daemon: Daemon) -> Iterator[anthropic.Anthropic]:
    a = anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0, timeout=300)
    yield a
    a.close()


def post(
    d: Daemon, path: str, body: object, headers: dict[str, str] | None = None
) -> tuple[int, dict]:
    status, raw = d.request(
        "POST", path, json.dumps(body).encode(), {**JSON, **(headers or {})}, timeout=300
    )
    return status, json.loads(raw)


def sse(raw: bytes) -> list[tuple[str, dict]]:
    """(event, data) pairs of an Anthropic stream; each must be well-formed."""
    out = []
    for frame in raw.decode().split("\n\n"):
        if not frame.strip():
            continue
        lines = dict(line.split(": ", 1) for line in frame.split("\n"))
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"]
        out.append((lines["event"], data))
    return out


def count(d: Daemon, body: dict) -> int:
    status, out = post(
        d,
        "/v1/messages/count_tokens",
        {k: v for k, v in body.items() if k not in ("max_tokens", "stream")},
    )
    assert status == 200, out
    return out["input_tokens"]


def test_root_count_tokens_and_errors_in_anthropic_shape(daemon: Daemon) -> None:
    assert (
        daemon.request("HEAD", "/")[0] == 200
        and json.loads(daemon.get("/")[1])["model"] == "test-model"
    )
    body = {
        "model": "test-model",
        "max_tokens": 8,
        "system": [{"type": "text", "text": "Be brief."}],
        "messages": HELLO,
    }
    assert (
        count(daemon, {**body, "system": "Be brief. Be kind. Be quick."}) > count(daemon, body) > 0
    )
    bad = [
        ({"tools": [1]}, "tools[0]"),
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}, "text"),
        ({"system": [{"text": 1}]}, "system[0].type"),
        ({"messages": [5]}, "messages[0]"),
        ({"max_tokens": "8"}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"thinking": {"type": "sometimes"}}, "thinking.type"),
        ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"stop_sequences": [1]}, "stop_sequences[0]"),
        ({"temperature": "hot"}, "temperature"),
        (
            {"messages": [{"role": "system", "content": "x"}]},
            "system message must follow a user message",
        ),
        (
            {
                "messages": [
                    *HELLO,
                    {"role": "system", "content": "x"},
                    {"role": "user", "content": "y"},
                ]
            },
            "last message",
        ),
        (
            {
                "tools": [{"name": "f", "input_schema": {"type": "strin"}}],
                "tool_choice": {"type": "any"},
            },
            "tools[0]",
        ),
    ]
    for change, named in bad:
        for path in ("/v1/messages", "/v1/messages/count_tokens")[
            : 1 if {"max_tokens", "temperature"} & set(change) else 2
        ]:
            status, out = post(daemon, path, {**body, **change})
            assert (
                status == 400
                and out["type"] == "error"
                and out["error"]["type"] == "invalid_request_error"
            ), (change, out)
            assert named in out["error"]["message"], (change, out)
    for method, path, status in (
        ("GET", "/v1/messages", 405),
        ("POST", "/v1/messages/batches", 404),
    ):
        got, raw = daemon.request(method, path, b"{}", JSON)
        out = json.loads(raw)
        assert (
            got == status
            and out["type"] == "error"
            and out["error"]["type"] in ("invalid_request_error", "not_found_error")
        )
    status, out = post(daemon, "/v1/messages", {**body, "model": "claude-sonnet-5"})
    assert (
        status == 404
        and out["error"]["type"] == "not_found_error"
        and "test-model" in out["error"]["message"]
    )


def test_claude_code_fields_are_taken(daemon: Daemon, sdk: anthropic.Anthropic) -> None:
    """What Claude Code sends besides the conversation: accepted (README "Claude Code" says what each does here)."""
    cc = {"type": "ephemeral"}
    ask = [
        {"role": "user", "content": [{"type": "text", "text": "Say hello.", "cache_control": cc}]},
        {"role": "system", "content": "Answer in French."},
    ]  # a mid-conversation system message, as Claude Code sends
    extra = {
        "thinking": {"type": "adaptive"},
        "output_config": {"effort": "high"},
        "metadata": {"user_id": "u"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "temperature": 0,
    }
    m = sdk.messages.create(
        model="test-model",
        max_tokens=64000,
        system=[{"type": "text", "text": "Be brief.", "cache_control": cc}],
        messages=ask,
        extra_body=extra,
        extra_query={"beta": "true"},
        extra_headers={"anthropic-beta": "claude-code-20250219,context-management-2025-06-27"},
    )
    # 64000 is past the demo's 8192-token context: cut to what remains, not refused.
    assert m.content[0].type == "text" and m.stop_reason in ("end_turn", "max_tokens"), m
    body = {"model": "test-model", "system": "Be brief.", "messages": ask, **extra}
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == count(daemon, body)
    assert count(daemon, body) > count(
        daemon, {**body, "messages": ask[:1]}
    )  # the system message is in the prompt
    for thinking in ({"type": "enabled", "budget_tokens": 2048}, {"type": "disabled"}):
        m = sdk.messages.create(
            model="test-model",
            max_tokens=4096,
            messages=HELLO,
            extra_body={**extra, "thinking": thinking},
        )
        assert m.content and m.stop_reason in ("end_turn", "max_tokens")


def test_stop_sequences_and_top_k(sdk: anthropic.Anthropic) -> None:
    story = [{"role": "user", "content": "Write a long story about a dragon."}]
    free = sdk.messages.create(model="test-model", max_tokens=24, messages=story, extra_body=T0)
    words = free.content[0].text.split()
    stop = words[len(words) // 2]
    for stream in (False, True):
        if stream:
            with sdk.messages.stream(
                model="test-model",
                max_tokens=24,
                messages=story,
                stop_sequences=["zzzq", stop],
                extra_body=T0,
            ) as s:
                m = s.get_final_message()
        else:
            m = sdk.messages.create(
                model="test-model",
                max_tokens=24,
                messages=story,
                stop_sequences=["zzzq", stop],
                extra_body=T0,
            )
        assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop, m
        assert free.content[0].text.startswith(m.content[0].text) and stop not in m.content[0].text
    # top_k=1 samples the most likely token: greedy, whatever the temperature.
    k1 = sdk.messages.create(
        model="test-model",
        max_tokens=24,
        messages=story,
        extra_body={"temperature": 1.0, "top_k": 1},
    )
    assert k1.content[0].text == free.content[0].text


def test_tools_with_claude_code_schemas_and_a_forced_call_cut_by_max_tokens(
    daemon: Daemon, sdk: anthropic.Anthropic
) -> None:
    schema = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "type": "object",
        "additionalProperties": False,
        "$defs": {
            "Task": {
                "type": "object",
                "properties": {"subject": {"type": "string", "maxLength": 12}},
                "required": ["subject"],
            }
        },
        "properties": {
            "task": {"$ref": "#/$defs/Task"},
            "metadata": {"type": "object", "propertyNames": {"type": "string"}, "maxProperties": 0},
        },
        "required": ["task"],
    }
    tools = [{"name": "TaskCreate", "description": "Create a task", "input_schema": schema}]
    ask = [{"role": "user", "content": "Create a task to buy milk."}]
    for choice in ({"type": "auto"}, {"type": "none"}):
        assert (
            sdk.messages.create(
                model="test-model",
                max_tokens=8,
                messages=ask,
                tools=tools,
                tool_choice=choice,
                extra_body=T0,
            ).content
            is not None
        )
    m = sdk.messages.create(
        model="test-model",
        max_tokens=60,
        messages=ask,
        tools=tools,
        tool_choice={"type": "tool", "name": "TaskCreate"},
        extra_body=T0,
    )
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use"
    jsonschema.validate(use.input, schema)
    # Cut mid-call: 200, stop_reason max_tokens, the call with what parsed of its input (never a 500).
    for stream in (False, True):
        body = {
            "model": "test-model",
            "max_tokens": 20,
            "messages": ask,
            "tools": tools,
            "stream": stream,
            **T0,
            "tool_choice": {"type": "tool", "name": "TaskCreate"},
        }
        status, raw = daemon.request("POST", "/v1/messages", json.dumps(body).encode(), JSON)
        assert status == 200, raw
        if stream:
            events = sse(raw)
            assert (
                events[-1][0] == "message_stop"
                and events[-2][1]["delta"]["stop_reason"] == "max_tokens"
            )
        else:
            out = json.loads(raw)
            assert (
                out["stop_reason"] == "max_tokens" and out["content"][-1]["type"] == "tool_use"
            ), out
            assert isinstance(out["content"][-1]["input"], dict)


def test_a_stream_waiting_in_the_queue_gets_pings_before_content(daemon: Daemon) -> None:
    """max_running = 1: the second stream waits behind the first, and hears `ping` every few seconds meanwhile."""
    # A ~2,400-token prompt: its prefill alone outlasts a ping interval on a quiet machine (160 greedy tokens
    # of a short prompt took 4.4 s there, and EOS may come sooner).
    story = "Write a long story about a dragon. " + "The dragon slept. " * 480
    long = {
        "model": "test-model",
        "max_tokens": 160,
        "messages": [{"role": "user", "content": story}],
        **T0,
    }
    first = threading.Thread(target=post, args=(daemon, "/v1/messages", long))
    first.start()
    time.sleep(1.0)
    t0 = time.monotonic()
    quick = {"model": "test-model", "max_tokens": 4, "messages": HELLO, "stream": True}
    status, raw = daemon.request("POST", "/v1/messages", json.dumps(quick).encode(), JSON)
    first.join()
    kinds = [e for e, _ in sse(raw)]
    assert status == 200 and kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert time.monotonic() - t0 > 5.5, (
        "the first request ended too soon to test a wait of a ping's interval"
    )
    assert "ping" in kinds[: kinds.index("content_block_start")], kinds


# -- the recorded requests, and the real CLI ---------------------------------------------------------------


def recorded() -> list[dict]:
    return [
        r
        for f in sorted(FIXTURES.glob("claude-*.json"))
        for r in json.loads(f.read_text())["requests"]
    ]


def test_recorded_claude_code_requests_replay(daemon: Daemon) -> None:
    """What Claude Code sent (tests/data/agents/claude-*.json), sent again: counted, and answered 200 with a
    well-formed stream wherever the prompt fits the demo's 8192-token context (the full session's 20k does not:
    that one's only refusal must be its length). max_tokens is cut to 16: the recorded 32000 would be clamped
    to the context and let the demo write for minutes."""
    reqs = recorded()
    assert {r["path"] for r in reqs} >= {"/", "/v1/messages?beta=true"}
    for r in reqs:
        headers = {
            k: v
            for k, v in r["headers"].items()
            if k.startswith(("anthropic-", "x-", "content-type"))
        }
        headers["x-api-key"] = "unused"
        if r["body"] is None:
            assert daemon.request(r["method"], r["path"], None, headers)[0] == 200, r["path"]
            continue
        assert count(daemon, r["body"]) > 0
        body = {**r["body"], "max_tokens": 16}
        status, raw = daemon.request(
            r["method"], r["path"], json.dumps(body).encode(), headers, timeout=300
        )
        if status == 400 and b"maximum context length" in raw:
            continue
        assert status == 200, raw[:500]
        if body.get("stream"):
            events = sse(raw)
            assert events[0][0] == "message_start" and events[-1][0] == "message_stop", events
        else:
            assert json.loads(raw)["type"] == "message"


@pytest.fixture(scope="module")
def claude() -> Path:
    exe = claude_bin()
    if exe is None:
        pytest.skip("node/npm are not installed: the recorded requests replay instead")
    return exe


def test_claude_code_cli_answers(daemon: Daemon, claude: Path) -> None:
    """The real CLI, unchanged, configured only by its env vars; its system prompt and tools trimmed by its own flags
    so the demo prefills it in seconds (the whole default session: the slow test below)."""
    run = run_claude(
        claude,
        daemon.port,
        "test-model",
        "say hi",
        "--system-prompt",
        "You are terse.",
        "--tools",
        "",
        timeout=300,
        max_output_tokens=SHORT,
    )
    calls = [(r["method"], r["path"], r["status"]) for r in run.records]
    assert calls[0] == ("HEAD", "/", 200) and set(calls[1:]) == {
        ("POST", "/v1/messages?beta=true", 200)
    }, calls
    # The demo samples (Claude Code sends no temperature): an answer it does not end within SHORT tokens makes the
    # CLI resume it, then give up with its own message. The protocol held either way; the answer's length is the model's.
    ended = run.returncode == 0 and run.stdout.strip()
    assert ended or "output token maximum" in run.stdout, (
        run.returncode,
        run.stdout,
        run.stderr[-2000:],
    )


def test_a_second_session_after_a_restart_resumes_from_disk(
    daemon: Daemon, claude: Path, demo_store: Path
) -> None:
    """Two Claude Code sessions with different prompts, the daemon restarted between them: the second one's first
    request resumes from the prompt state the first session left on the drive ([cache] prompt_disk_bytes), i.e. all
    of its system prompt and reminder before its own words. Claude Code's first system block, its billing header,
    differs between the sessions (a hash of the request): the daemon leaves it out of the prompt, or they would
    share a dozen tokens."""
    args = ("--system-prompt", "You are terse.", "--tools", "")
    # 4 output tokens: only the prompts matter here (the CLI resumes a cut answer 3 times, then gives up)
    first = run_claude(
        claude, daemon.port, "test-model", "say hi", *args, timeout=300, max_output_tokens=4
    )
    assert daemon.stop() == 0  # a clean stop writes what is still queued
    daemon.start()
    second = run_claude(
        claude,
        daemon.port,
        "test-model",
        "please say hello",
        *args,
        timeout=300,
        max_output_tokens=4,
    )
    (_, a), (j, b) = (
        next((k, r) for k, r in enumerate(run.records) if r["method"] == "POST")
        for run in (first, second)
    )
    assert a["body"]["system"][0]["text"] != b["body"]["system"][0]["text"], (
        "the billing headers no longer differ"
    )
    assert a["body"]["system"][0]["text"].startswith("x-anthropic-billing-header:")
    usage = next(data for kind, data in sse(second.answers[j]) if kind == "message_delta")["usage"]
    tok = Tokenizer.load(demo_store / "tokenizer")
    ids = []
    for rec in (a, b):
        chat = parse_body(to_chat(rec["body"]), chat=True)
        ids.append(plan_chat(tok, chat, chat_messages(chat), True).prompt_ids)
    shared = next(k for k, (x, y) in enumerate(zip(*ids, strict=False)) if x != y)
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == len(ids[1])
    assert usage["cache_read_input_tokens"] == shared > 0.8 * len(ids[1]), (
        usage,
        shared,
        len(ids[1]),
    )
    assert "prompt_disk_loaded" in daemon.log_text(full=True)


@pytest.mark.slow
def test_claude_code_cli_default_session_on_k3(claude: Path, tmp_path: Path) -> None:
    """Claude Code's whole default prompt (24 tools, ~62k tokens on the tiny K3's byte-level tokenizer), sent with
    `Authorization: Bearer` (ANTHROPIC_AUTH_TOKEN). Its prefill takes minutes on CPU, and the session's follow-up
    requests finish in time only where the prefix cache keeps the first one's state (on 2 busy cores: the first
    request answered 200 after 568 s, the next was still prefilling all 62k tokens again at 900 s; with the
    prefix cache keeping KDA state, the whole session took 311-435 s)."""
    store = tmp_path / "k3"
    proc = deltafind_cmd(
        "setup", "--synthetic", "kimi_k3", "--shape", "tiny", "--store", str(store), "--quiet"
    )
    assert proc.returncode == 0, proc.stderr
    d = Daemon(store, "[server]\nmax_running = 1\nmax_prefill_tokens = 4096\n").start()
    try:
        run = run_claude(
            claude,
            d.port,
            "test-model",
            "say hi",
            timeout=900,
            key_env="ANTHROPIC_AUTH_TOKEN",
            max_output_tokens=SHORT,
        )
    finally:
        d.stop()
        d.cleanup()
    # Random weights think until max_tokens, so the CLI resumes the answer, then gives up with its own message.
    ended = run.returncode == 0 and run.stdout.strip()
    assert ended or "output token maximum" in run.stdout, (
        run.returncode,
        run.stdout,
        run.stderr[-2000:],
    )
    assert all(r["status"] == 200 for r in run.records), [
        (r["path"], r["status"]) for r in run.records
    ]
