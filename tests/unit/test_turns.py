"""TurnMemory on SmolLM2's real tokenizer: a prompt that repeats an answer spelled in other tokens
than BPE would choose gets the answer's own ids back, its text unchanged; anything else is left alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from deltafind.server.turns import TurnMemory
from deltafind.tokenizer import Tokenizer, write_tokenizer_from_gguf

CALL = '<tool_call>\n{"name": "read_file", "arguments": {"path": "test_file.txt"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok(demo_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    dest = tmp_path_factory.mktemp("smol")
    write_tokenizer_from_gguf(demo_gguf, dest)
    return Tokenizer.load(dest)


def history(tok: Tokenizer, *turns: str) -> list[dict]:
    msgs = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Why does it fail?"},
    ]
    for t in turns:
        msgs += [{"role": "assistant", "content": t}, {"role": "user", "content": "Go on."}]
    return msgs


def odd_spelling(tok: Tokenizer, text: str) -> list[int]:
    """`text` in ids BPE would not choose: split where the canonical encoding merges (as a grammar may steer)."""
    cut = text.index('"}}') + 2  # '"}' + '}' where BPE says '"' + '}}' (the demo's turn-1 answer)
    ids = tok.encode(text[:cut], add_bos=False) + tok.encode(text[cut:], add_bos=False)
    assert ids != tok.encode(text, add_bos=False) and tok.decode(ids) == text
    return ids


def test_a_sent_back_answer_keeps_the_generated_ids(tok: Tokenizer) -> None:
    mem = TurnMemory()
    prompt1 = tok.apply_chat_template(history(tok))
    answer = odd_spelling(tok, CALL) + tok.encode("<|im_end|>", allow_special=True)
    mem.remember(tok, prompt1 + answer)
    prompt2 = tok.apply_chat_template(history(tok, CALL))
    assert (
        prompt2[: len(prompt1 + answer)] != prompt1 + answer
    )  # re-encoding alone would miss the cache
    spliced = mem.splice(tok, prompt2)
    assert spliced[: len(prompt1 + answer)] == prompt1 + answer
    assert tok.decode(spliced) == tok.decode(prompt2)  # the same text, only spelled as generated
    # The chain goes on: turn 3 repeats turn 2's spliced prompt and its (canonical) answer.
    answer2 = tok.encode("It reads a file.", add_bos=False) + tok.encode(
        "<|im_end|>", allow_special=True
    )
    mem.remember(tok, spliced + answer2)
    prompt3 = tok.apply_chat_template(history(tok, CALL, "It reads a file."))
    assert mem.splice(tok, prompt3)[: len(spliced + answer2)] == spliced + answer2


def test_other_text_or_no_boundary_leaves_the_prompt_alone(tok: Tokenizer) -> None:
    mem = TurnMemory()
    prompt1 = tok.apply_chat_template(history(tok))
    mem.remember(
        tok, prompt1 + odd_spelling(tok, CALL) + tok.encode("<|im_end|>", allow_special=True)
    )
    edited = tok.apply_chat_template(
        history(tok, CALL.replace("test_file", "other"))
    )  # the client changed the answer
    assert mem.splice(tok, edited) == edited
    other = tok.apply_chat_template([{"role": "user", "content": "Something else entirely."}])
    assert mem.splice(tok, other) == other
    # The remembered text ends inside a token of the new prompt ('hello' | 'helloworld' is 'hel' 'low' 'orld'): no cut there.
    mem2 = TurnMemory()
    mem2.remember(tok, tok.encode("Say: hello", add_bos=False))
    prompt = tok.encode("Say: helloworld", add_bos=False)
    assert tok.decode(prompt).startswith("Say: hello") and mem2.splice(tok, prompt) == prompt
    assert TurnMemory().splice(tok, prompt) == prompt


def test_bounded_in_entries_and_tokens(tok: Tokenizer) -> None:
    mem = TurnMemory(max_entries=2, max_tokens=100)
    for word in ("one", "two", "three"):
        mem.remember(tok, tok.encode(word * 5, add_bos=False))
    assert len(mem) == 2
    mem.remember(tok, list(range(60)))
    mem.remember(tok, list(range(1, 61)))
    assert len(mem) == 1  # 120 tokens would pass the budget: the oldest went
    mem.remember(tok, list(range(101)))  # longer than the whole budget: never kept
    assert len(mem) == 1


def test_the_spellings_outlive_a_restart_under_the_same_key_only(
    tok: Tokenizer, tmp_path: Path
) -> None:
    mem = TurnMemory()
    prompt1 = tok.apply_chat_template(history(tok))
    answer = odd_spelling(tok, CALL) + tok.encode("<|im_end|>", allow_special=True)
    mem.remember(tok, prompt1 + answer)
    mem.save(tmp_path / "turns.safetensors", "key1")
    prompt2 = tok.apply_chat_template(history(tok, CALL))
    after = TurnMemory()  # a restarted daemon
    assert after.load(tok, tmp_path / "turns.safetensors", "key1") == 1
    assert after.splice(tok, prompt2)[: len(prompt1 + answer)] == prompt1 + answer
    other = TurnMemory()  # another tokenizer or template: the ids mean something else
    assert other.load(tok, tmp_path / "turns.safetensors", "key2") == 0 and len(other) == 0
