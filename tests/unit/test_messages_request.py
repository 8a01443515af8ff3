"""Anthropic request fields reach the prompt: effort and thinking on K3's template, a mid-conversation system message
at its place, Claude Code's billing header not at all. The K3 renderer (deltafind/tokenizer) is the independent judge
of what each field means. And the real CLIs' recorded sessions (Claude Code's Messages, Codex's Responses) render to
prompts that each extend the previous one, the prefix the cache reuses (tests/bench/RESULTS.md)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from deltafind.server.chat_plan import plan_chat
from deltafind.server.messages_request import to_chat
from deltafind.server.openai import chat_messages
from deltafind.server.schemas import parse_body
from deltafind.tokenizer import Tokenizer
from deltafind.tokenizer.kimi import write_k3_tokenizer
from tests.e2e.agent_session import RETRY_AT, main_requests, prompt_ids


@pytest.fixture(scope="module")
def k3(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder: Path = tmp_path_factory.mktemp("k3tok")
    write_k3_tokenizer(folder)
    return Tokenizer.load(folder)


def prompt(tok: Tokenizer, **fields) -> str:
    body = {
        "model": "m",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "Say hello."}],
        **fields,
    }
    chat = parse_body(to_chat(body), chat=True)
    return tok.decode(
        plan_chat(tok, chat, chat_messages(chat), True).prompt_ids, skip_special_tokens=False
    )


def test_effort_and_thinking_reach_k3s_template(k3: Tokenizer) -> None:
    low, high, xhigh = (prompt(k3, output_config={"effort": e}) for e in ("low", "high", "xhigh"))
    assert len({low, high, xhigh}) == 3 and xhigh == prompt(k3, output_config={"effort": "max"})
    assert (
        prompt(k3, thinking={"type": "adaptive"})
        == prompt(k3)
        != prompt(k3, thinking={"type": "disabled"})
    )
    assert prompt(
        k3, thinking={"type": "enabled", "budget_tokens": 1024}, max_tokens=2048
    ) == prompt(k3)


def test_a_mid_conversation_system_message_is_a_system_turn_at_its_place(k3: Tokenizer) -> None:
    text = prompt(
        k3,
        messages=[
            {"role": "user", "content": "Say hello."},
            {"role": "system", "content": [{"type": "text", "text": "Answer in French."}]},
        ],
    )
    assert text.index("Say hello.") < text.index("Answer in French.")
    plain = prompt(k3, messages=[{"role": "user", "content": "Say hello.\n\nAnswer in French."}])
    assert text != plain  # its own (system) turn, not text appended to the user's


def test_claude_codes_billing_header_is_not_in_the_prompt(k3: Tokenizer) -> None:
    """Claude Code's first system block hashes the request (tests/data/agents/session-claude.json): two sessions'
    prompts must not differ there, at position 0, or they share no prefix; the rest of the system text stays."""

    def system(header: str) -> list[dict]:
        return [
            {
                "type": "text",
                "text": f"x-anthropic-billing-header: cc_version=2.1.197.{header}; cc_entrypoint=sdk-cli;",
            },
            {"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}},
        ]

    first, second = prompt(k3, system=system("93e")), prompt(k3, system=system("123"))
    assert first == second == prompt(k3, system="You are terse.") and "billing" not in first
    assert (
        prompt(k3, system="x-anthropic-billing-header: cc_version=1.a; cch=1;\nYou are terse.")
        == first
    )
    assert "You are terse." in first and first != prompt(k3)


@pytest.mark.parametrize("cli", ["claude", "codex"])
def test_each_request_of_a_recorded_session_extends_the_previous_prompt(
    k3: Tokenizer, cli: str
) -> None:
    """Nothing per request (a header, a moved reminder, a reordered tool list) breaks the prefix between turns."""
    reqs = main_requests(cli)
    assert len(reqs) == 11 and reqs[RETRY_AT - 1]["status"] in (
        500,
        529,
    )  # 10 turns, one of them retried
    prompts = [prompt_ids(k3, cli, r["body"]) for r in reqs]
    assert prompts[RETRY_AT] == prompts[RETRY_AT - 1]  # the retry: the same prompt
    for before, after in itertools.pairwise(prompts):
        assert after[: len(before)] == before
