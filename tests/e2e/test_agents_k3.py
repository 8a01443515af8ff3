"""Kimi K3 agent turns against the real daemon (synthetic K3 store, openai client): a turn with
tool_choice "required" renders a system message after the history (docs/kimi-k3-format.md §6.6), and the next turn
resumes from the prefix-cache checkpoint the engine kept where that history ended (KDA state
included), instead of prefilling the whole prompt again."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from deltafind.server.chat_plan import plan_chat
from deltafind.server.openai import chat_messages
from deltafind.server.schemas import ChatRequest
from deltafind.tokenizer import Tokenizer
from tests.conftest import deltafind_cmd
from tests.e2e.daemon_fixtures import Daemon

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the project",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "maxLength": 20}},
                "required": ["path"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def k3_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    store = tmp_path_factory.mktemp("k3") / "store"
    proc = deltafind_cmd(
        "setup", "--synthetic", "kimi_k3", "--shape", "tiny", "--store", str(store), "--quiet"
    )
    assert proc.returncode == 0, proc.stderr
    return store


@pytest.fixture(scope="module")
def k3_daemon(k3_store: Path) -> Iterator[Daemon]:
    d = Daemon(k3_store, "[server]\nmax_running = 1\n").start()
    yield d
    d.stop()
    d.cleanup()


def test_required_turns_resume_where_the_history_ended(k3_daemon: Daemon, k3_store: Path) -> None:
    tok = Tokenizer.load(k3_store / "tokenizer")
    c = openai.OpenAI(base_url=k3_daemon.url + "/v1", api_key="x", max_retries=0, timeout=600)
    msgs: list[dict] = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Why does test_parse fail?"},
    ]
    prev = None
    for turn in range(3):
        req = dict(
            model="test-model",
            messages=msgs,
            tools=TOOLS,
            tool_choice="required",
            temperature=0,
            max_tokens=12,
            extra_body={"chat_template_kwargs": {"thinking": False}},
        )  # random weights never close a thought
        r = c.chat.completions.create(**req)
        body = ChatRequest(
            **{k: v for k, v in req.items() if k != "extra_body"}, **req["extra_body"]
        )
        plan = plan_chat(tok, body, chat_messages(body))
        assert (
            len(plan.prompt_ids) == r.usage.prompt_tokens
            and 0 < plan.history_end < r.usage.prompt_tokens
        )
        details = r.usage.prompt_tokens_details
        cached = details.cached_tokens if details else 0
        if prev is None:
            assert cached == 0
        else:  # the previous history, served from the checkpoint; its answer and tail are run again
            assert cached == prev
        prev = plan.history_end
        m = r.choices[0].message
        msgs += [
            {"role": "assistant", "content": m.content or ""},
            {"role": "user", "content": f"Go on ({turn})."},
        ]


def test_a_restart_reuses_the_prompt_from_disk(k3_store: Path, tmp_path: Path) -> None:
    """[cache] prompt_disk_bytes: the same long prompt after a daemon restart is served from the file the
    first daemon wrote (KDA and MLA state), with the tokens the first daemon gave."""
    folder = tmp_path / "prompts"
    config = f'[server]\nmax_running = 1\n[cache]\nprompt_disk_bytes = "64MiB"\nprompt_disk_dir = "{folder}"\n'
    system = "You are a coding agent. " + " ".join(
        f"Rule {i}: keep file {i} tidy." for i in range(40)
    )
    req = dict(
        model="test-model",
        temperature=0,
        max_tokens=8,
        extra_body={"chat_template_kwargs": {"thinking": False}},
        messages=[
            {"role": "system", "content": system},
            {"role": "user", "content": "Why does test_parse fail?"},
        ],
    )
    runs = []
    for _ in range(2):
        d = Daemon(k3_store, config).start()
        try:
            r = openai.OpenAI(
                base_url=d.url + "/v1", api_key="x", max_retries=0, timeout=600
            ).chat.completions.create(**req)
            runs.append((r, d.log_text(full=True)))
        finally:
            assert d.stop() == 0  # a clean stop writes what is still queued
            d.cleanup()
    (first, _), (second, log) = runs
    assert first.usage.prompt_tokens > 300
    assert (
        first.usage.prompt_tokens_details is None
        or not first.usage.prompt_tokens_details.cached_tokens
    )
    assert (
        second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1
    )  # all but the last token
    assert second.choices[0].message.content == first.choices[0].message.content
    assert "prompt_disk_loaded" in log and "prompt_disk_dropped" not in log


def test_responses_reasoning_round_trips_through_encrypted_content(k3_daemon: Daemon) -> None:
    # Codex sends store: false and include: ["reasoning.encrypted_content"], then replays the reasoning
    # items (encrypted_content only) in the next request's input: they must render the thought again.
    first = {
        "model": "test-model",
        "input": "Why does test_parse fail?",
        "max_output_tokens": 6,
        "temperature": 0,
        "store": False,
        "include": ["reasoning.encrypted_content"],
    }
    status, r = k3_daemon.post_json("/v1/responses", first, timeout=600)
    assert status == 200, r
    item = next(o for o in r["output"] if o["type"] == "reasoning")
    thought = item["content"][0]["text"]
    assert thought and item["encrypted_content"] and thought not in item["encrypted_content"]
    assert (
        r["usage"]["output_tokens_details"]["reasoning_tokens"] == r["usage"]["output_tokens"] == 6
    )  # random weights think on

    def turn(reasoning: dict | None) -> list[dict]:
        return [
            {"role": "user", "content": "Why does test_parse fail?"},
            *([reasoning] if reasoning else []),
            {
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Look at the parser."}],
            },
            {"role": "user", "content": "Go on."},
        ]

    counts = []
    for reasoning in (
        {
            "type": "reasoning",
            "summary": [],
            "content": None,
            "encrypted_content": item["encrypted_content"],
        },
        {
            "type": "reasoning",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": thought}],
        },
        None,
    ):
        status, c = k3_daemon.post_json(
            "/v1/responses/input_tokens", {"model": "test-model", "input": turn(reasoning)}
        )
        assert status == 200, c
        counts.append(c["input_tokens"])
    assert counts[0] == counts[1] != counts[2]
