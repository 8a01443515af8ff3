"""The Codex CLI against the real daemon on the demo store: its recorded requests replayed (always),
a live `codex exec` session where node is present (~2k prompt tokens: tests/e2e/codex_cli.py turns off
its sub-agent and goal tools and web search with its own config), and the Responses
features it leans on: namespace tools, hosted tools ignored, model aliases, input_tokens, hang-ups,
and 400s (not 500s) for wrong JSON types."""

from __future__ import annotations

import copy
import json
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.codex_cli import FIXTURES, codex_bin, run_codex
from tests.e2e.daemon_fixtures import Daemon

RECORDED = sorted(FIXTURES.glob("codex-*.json"))
ALIAS = "gpt-5.2-codex"
SENT_BACK = {
    "accept",
    "content-type",
    "originator",
    "user-agent",
    "session-id",
    "thread-id",
    "x-client-request-id",
}


@pytest.fixture(scope="module")
def daemon(demo_store: Path) -> Iterator[Daemon]:
    # Prefill in chunks of 256, so a prompt whose client left stops at the next chunk. Codex sends no
    # temperature and no token limit: sampled at 1.0 the demo can ramble to the end of its context, so
    # the operator's default makes it greedy (it then ends its answer on its own).
    d = Daemon(
        demo_store,
        "[server]\nmax_running = 2\nmax_prefill_tokens = 256\ntemperature_default = 0\n"
        f'model_aliases = ["{ALIAS}"]\n',
    ).start()
    yield d
    d.stop()
    d.cleanup()


def requests() -> list[tuple[str, dict]]:
    out = []
    for path in RECORDED:
        for i, rec in enumerate(json.loads(path.read_text())["requests"]):
            if rec["method"] == "POST" and rec["path"].startswith("/v1/responses"):
                out.append((f"{path.stem}[{i}]", rec))
    return out


def sse(raw: bytes) -> list[tuple[str, dict]]:
    """(event, data) per SSE event; comments (keep-alives) skipped."""
    out = []
    for block in raw.decode().split("\n\n"):
        lines = [ln for ln in block.split("\n") if ln and not ln.startswith(":")]
        if lines:
            kind = next(ln[7:] for ln in lines if ln.startswith("event: "))
            out.append((kind, json.loads(next(ln[6:] for ln in lines if ln.startswith("data: ")))))
    return out


def check_stream(events: list[tuple[str, dict]]) -> dict:
    """The Responses event grammar: created, in_progress, items opened/grown/closed in order, then completed."""
    kinds = [k for k, _ in events]
    assert (
        kinds[:2] == ["response.created", "response.in_progress"]
        and kinds[-1] == "response.completed"
    ), kinds
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    open_items: set[int] = set()
    for kind, data in events[2:-1]:
        if kind == "response.output_item.added":
            assert data["output_index"] not in open_items
            open_items.add(data["output_index"])
        elif kind == "response.output_item.done":
            open_items.remove(data["output_index"])
        else:
            assert data["output_index"] in open_items, (kind, data)
    assert not open_items
    final = events[-1][1]["response"]
    assert final["status"] == "completed" and final["output"]
    return final


def post_recorded(
    daemon: Daemon, rec: dict, body: dict, path: str = "/v1/responses"
) -> tuple[int, bytes]:
    headers = {
        k: v for k, v in rec["headers"].items() if k in SENT_BACK or k.startswith("x-codex-")
    }
    return daemon.request("POST", path, json.dumps(body).encode(), headers, timeout=900)


def shrunk(body: dict) -> dict:
    """The recorded request with every field, header and tool type, but small: one function tool, the
    namespace with one function, the hosted web_search; the developer prompt and the user's request."""
    b = copy.deepcopy(body)
    ns = next(t for t in b["tools"] if t["type"] == "namespace")
    ns["tools"] = ns["tools"][:1]
    b["tools"] = [
        next(t for t in b["tools"] if t["type"] == "function"),
        ns,
        *[t for t in b["tools"] if t["type"] == "web_search"],
    ]
    for t in b["tools"]:
        t.pop("description", None)
    b["input"] = [
        {**b["input"][0], "content": [{"type": "input_text", "text": "You are a coding agent."}]},
        b["input"][-1],
    ]
    b["temperature"] = 0  # Codex sends none; greedy, the demo ends its answer on its own
    return b


@pytest.mark.parametrize(("name", "rec"), requests(), ids=[n for n, _ in requests()])
def test_recorded_request_is_counted_and_streams_whole(
    daemon: Daemon, name: str, rec: dict
) -> None:
    body = rec["body"]
    assert {"client_metadata", "include", "prompt_cache_key", "store", "reasoning"} <= set(body)
    assert {"namespace", "web_search", "function"} <= {t["type"] for t in body["tools"]}
    status, raw = post_recorded(daemon, rec, body, "/v1/responses/input_tokens")
    counted = json.loads(raw)
    assert (
        status == 200
        and counted["object"] == "response.input_tokens"
        and counted["input_tokens"] > 1000
    ), counted
    status, raw = post_recorded(daemon, rec, shrunk(body))
    assert status == 200, raw[:500]
    final = check_stream(sse(raw))
    assert final["output"][-1]["type"] in ("message", "function_call")
    assert (
        final["usage"]["output_tokens_details"]["reasoning_tokens"] == 0
    )  # the demo does not think
    assert "hosted_tools_ignored" in daemon.log_text()


@pytest.mark.slow
@pytest.mark.parametrize(("name", "rec"), requests(), ids=[n for n, _ in requests()])
def test_recorded_request_replayed_as_sent(daemon: Daemon, name: str, rec: dict) -> None:
    # ~5.5k prompt tokens on the demo: minutes on a shared 2-core machine.
    counted = json.loads(post_recorded(daemon, rec, rec["body"], "/v1/responses/input_tokens")[1])[
        "input_tokens"
    ]
    status, raw = post_recorded(daemon, rec, {**rec["body"], "temperature": 0})
    # Codex's own ~4k-token instructions: over the demo's context, refused as the reference API does
    if counted >= 8192:
        assert status == 400 and json.loads(raw)["error"]["code"] == "context_length_exceeded", raw[
            :500
        ]
        return
    assert status == 200, raw[:500]
    check_stream(sse(raw))


def test_codex_exec_completes(daemon: Daemon) -> None:
    exe = codex_bin()
    if exe is None:
        pytest.skip("node/npm not installed: the recorded requests are replayed instead")
    run = run_codex(exe, daemon.port, ALIAS, "Say hello in one short sentence.")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.answer.strip(), run.stdout[-2000:]
    assert run.records and all(r.get("status") == 200 for r in run.records), run.records


NS_TOOLS = [
    {
        "type": "namespace",
        "name": "files",
        "description": "File tools",
        "tools": [
            {
                "type": "function",
                "name": "read",
                "parameters": {
                    "type": "object",
                    "properties": {"path": {"type": "string"}},
                    "required": ["path"],
                },
            }
        ],
    },
    {"type": "web_search"},
    {"type": "image_generation"},
]


def test_namespace_call_comes_back_named_and_replays(daemon: Daemon) -> None:
    base = {
        "model": ALIAS,
        "tools": NS_TOOLS,
        "temperature": 0,
        "max_output_tokens": 48,
        "store": False,
    }
    status, r = daemon.post_json(
        "/v1/responses", {**base, "input": "Read README.md", "tool_choice": "required"}
    )
    assert status == 200, r
    call = next(o for o in r["output"] if o["type"] == "function_call")
    assert (call["namespace"], call["name"]) == ("files", "read") and json.loads(call["arguments"])[
        "path"
    ]
    history = [
        {"role": "user", "content": "Read README.md"},
        call,
        {
            "type": "function_call_output",
            "call_id": call["call_id"],
            "output": "# deltafind",
            "namespace": "files",
        },
    ]
    status, r2 = daemon.post_json("/v1/responses", {**base, "input": history})
    assert status == 200 and r2["output"], r2
    assert r2["usage"]["input_tokens"] > r["usage"]["input_tokens"]


def test_aliases_are_listed_and_answer(daemon: Daemon) -> None:
    status, raw = daemon.get("/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(raw)["data"]] == ["test-model", ALIAS]
    assert daemon.get(f"/v1/models/{ALIAS}")[0] == 200
    status, r = daemon.post_json("/v1/responses/input_tokens", {"model": ALIAS, "input": "hi"})
    assert status == 200 and r["input_tokens"] > 0
    assert (
        daemon.post_json("/v1/responses/input_tokens", {"model": "other", "input": "hi"})[0] == 404
    )


BAD_RESPONSES = [
    ({"previous_response_id": {}}, "previous_response_id"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
        "input[0].content[0].text",
    ),
    (
        {"input": [{"type": "reasoning", "content": 5}, {"role": "user", "content": "x"}]},
        "input[0].content",
    ),
    (
        {"input": [{"type": "reasoning", "encrypted_content": "gAAAAAB-openai-blob"}]},
        "input[0].encrypted_content",
    ),
    ({"input": [{"type": "function_call", "name": 3, "call_id": "c"}]}, "input[0].name"),
    ({"tools": [{"type": "namespace", "name": "n", "tools": 7}]}, "tools[0].tools"),
    ({"tools": [{"type": "teleport"}]}, "tools[0].type"),
]
BAD_CHAT = [
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"self": 1}}, "chat_template_kwargs"),
    (
        {
            "messages": [
                {"role": "user", "content": "x"},
                {"role": "assistant", "tool_calls": [{"function": 1}]},
            ]
        },
        "messages[1].tool_calls",
    ),
]


@pytest.mark.parametrize(("extra", "param"), BAD_RESPONSES)
def test_wrong_types_on_responses_are_400_naming_the_field(
    daemon: Daemon, extra: dict, param: str
) -> None:
    status, r = daemon.post_json(
        "/v1/responses", {"model": "test-model", "input": "hi", "max_output_tokens": 2, **extra}
    )
    assert status == 400 and r["error"]["param"] == param, r


@pytest.mark.parametrize(("extra", "param"), BAD_CHAT)
def test_wrong_types_on_chat_are_400_naming_the_field(
    daemon: Daemon, extra: dict, param: str
) -> None:
    body = {
        "model": "test-model",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        **extra,
    }
    status, r = daemon.post_json("/v1/chat/completions", body)
    assert status == 400 and r["error"]["param"] == param, r


HANG_UP_BODY = {
    "/v1/responses": lambda text: {"max_output_tokens": 400, "input": text},
    "/v1/completions": lambda text: {"max_tokens": 400, "prompt": text},
    "/v1/chat/completions": lambda text: {
        "max_tokens": 400,
        "messages": [{"role": "user", "content": text}],
    },
    "/v1/messages": lambda text: {
        "max_tokens": 400,
        "messages": [{"role": "user", "content": text}],
    },
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", list(HANG_UP_BODY))
def test_a_hang_up_during_prefill_is_noticed_within_a_second(
    daemon: Daemon, path: str, stream: bool
) -> None:
    text = (
        f"{path} {stream}: the history of Paris. " * 60
    )  # ~500 tokens, new to the prefix cache: still prefilling at 0.5 s
    body = {"model": "test-model", **HANG_UP_BODY[path](text)}
    raw = json.dumps({**body, "stream": stream}).encode()
    before = daemon.log_text(full=True).count('"client_gone"')
    with socket.create_connection(("127.0.0.1", daemon.port)) as s:
        s.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n".encode()
            + raw
        )
        time.sleep(0.5)
    closed = time.monotonic()
    while (
        time.monotonic() - closed < 1.5
        and daemon.log_text(full=True).count('"client_gone"') == before
    ):
        time.sleep(0.05)
    assert daemon.log_text(full=True).count('"client_gone"') > before, (
        "the hang-up was not noticed within a second"
    )
    assert "Traceback" not in daemon.log_text(full=True)
    if not stream:  # the request thread answers at once; the engine frees the slot at its next step
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not re.search(
            rf'"path": "{path}", "status": 499', daemon.log_text(full=True)
        ):
            time.sleep(0.2)
        assert re.search(rf'"path": "{path}", "status": 499', daemon.log_text(full=True))


def test_a_long_prefill_streams_keep_alive_comments(daemon: Daemon) -> None:
    text = (
        "Paris is lovely in the spring. " * 350
    )  # ~2.5k new tokens: many seconds of prefill on the demo
    raw = json.dumps(
        {"model": "test-model", "input": text, "stream": True, "max_output_tokens": 4}
    ).encode()
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=30) as s:
        s.sendall(
            f"POST /v1/responses HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n".encode()
            + raw
        )
        got, started = b"", time.monotonic()
        comment = b"\n: keep-alive\n\n"  # an SSE comment line (not the Connection header)
        while comment not in got and time.monotonic() - started < 20:
            got += s.recv(65536)
        assert b"event: response.created" in got and comment in got, got[-500:]
        assert (
            b"response.output_text.delta" not in got
        )  # it came while the prompt was still prefilling
