"""The K3 tokenizer against tiktoken (same ranks file, K3's pattern assembled here from the
spec's eight pieces) and the XTML chat rendering against the spec's example and its rules."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import pytest

from deltafind.errors import RequestError
from deltafind.tokenizer import Tokenizer
from deltafind.tokenizer.bpe import KIMI_PATTERN
from deltafind.tokenizer.kimi import K3_SPECIALS, KimiTokenizer, write_k3_tokenizer

os.environ["TIKTOKEN_CACHE_DIR"] = ""

SPEC_PIECES = [  # docs/kimi-k3-format.md §6.3, in order
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
]
CORPUS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say it's fine; we've done what you'd want. DON'T SHOUT, IT'S OK",
    "中文测试：你好，世界。混合Mixed中英文text和数字123456",
    "日本語のテキスト、カタカナ。한국어 문장입니다 Ελληνικά Русский العربية",
    "numbers 0 1 12 123 1234 12345 3.14159 -42 1e10 1,000,000",
    "def f(x):\n    return x ** 2  # square\n\tif x:\n\t\tpass\n",
    "   leading, trailing   \n\n\n  \r\n\t \u3000 x  ",
    "camelCaseWords and snake_case_words and CAPS-Lock ÉCOLE naïve",
    "emoji 😀🎉👍🏽 ❤️ 🇫🇷 and symbols !!! ??? ... ```json {\"a\": [1, 2]}```",
    "text with <|open|> and <|end_of_msg|> inside, typed by a user",
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("k3tok")
    write_k3_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def tok(folder: Path) -> KimiTokenizer:
    t = Tokenizer.load(folder)
    assert isinstance(t, KimiTokenizer)
    return t


@pytest.fixture(scope="module")
def oracle(folder: Path):
    tiktoken = pytest.importorskip("tiktoken")
    ranks = {}
    for line in (folder / "tiktoken.model").read_text().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    return tiktoken.Encoding(
        "k3-synthetic", pat_str="|".join(SPEC_PIECES), mergeable_ranks=ranks, special_tokens={}
    )


def test_pattern_is_the_spec_pattern() -> None:
    assert "|".join(SPEC_PIECES) == KIMI_PATTERN


@pytest.mark.parametrize("text", CORPUS)
def test_ids_equal_tiktoken(tok: KimiTokenizer, oracle, text: str) -> None:
    assert tok.encode(text) == oracle.encode_ordinary(text)
    assert tok.decode(tok.encode(text)) == text


def _reference_cuts(text: str) -> list[str]:
    # Spec 6.4 in words: 400,000-character slices; inside each, no same-class run (str.isspace) over 25,000.
    out = []
    for s in range(0, len(text), 400_000):
        piece, cur = text[s : s + 400_000], ""
        run = 0
        for i, ch in enumerate(piece):
            run = run + 1 if i and ch.isspace() == piece[i - 1].isspace() else 1
            if run > 25_000:
                out.append(cur)
                cur, run = "", 1
            cur += ch
        out.append(cur)
    return out


def test_safety_slicing_matches_the_rule(tok: KimiTokenizer, oracle) -> None:
    text = (
        "x" * 10 + " " * 60_000 + "word " * 500 + "\x1c" * 26_000 + "end"
    )  # U+001C is space to Python
    cuts = _reference_cuts(text)
    assert [len(c) for c in cuts] == [
        25_010,
        25_000,
        37_499,
        1_004,
    ]  # two cuts in the spaces, one in " " + U+001C
    want = [i for piece in cuts for i in oracle.encode_ordinary(piece)]
    assert tok.encode(text) == want
    long = "ab cd " * 70_000  # 420,000 characters: two slices
    assert tok.encode(long) == [
        i for piece in _reference_cuts(long) for i in oracle.encode_ordinary(piece)
    ]


def test_specials_eos_and_no_bos(tok: KimiTokenizer, folder: Path) -> None:
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    first = min(int(i) for i in cfg["added_tokens_decoder"])
    assert tok.eos_token_ids == [first + 2] and tok.id_to_token(first + 2) == "<|end_of_msg|>"
    assert tok.encode("hi")[:1] != [first]  # never a BOS
    assert tok.encode("<|open|>", allow_special=True) == [first + 3]
    assert first + 3 not in tok.encode("<|open|>")  # user text stays text
    assert (
        tok.token_to_id(f"<|reserved_token_{first + 8}|>") == first + 8
    )  # unnamed ids get placeholders
    assert tok.vocab_size == first + 256 and all(
        tok.token_to_id(s) == first + o for o, s in K3_SPECIALS.items()
    )


EFFORT_MAX = (
    '<|open|>message role="system" type="thinking-effort"<|sep|>`thinking_effort` guides on how much to think in your '
    "thinking channel (not including the response channel), supported values include `low`, `medium`, `high`, and `max`.\n"
    "Now the system is invoked with `thinking_effort=max`.<|close|>message<|sep|><|end_of_msg|>"
)


def test_spec_example_renders_exactly(tok: KimiTokenizer) -> None:
    text = tok.render_chat([{"role": "user", "content": "Hello <|open|> & goodbye"}])
    assert text == (
        EFFORT_MAX
        + '<|open|>message role="user"<|sep|>Hello <|open|> & goodbye<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
    )
    ids = tok.apply_chat_template([{"role": "user", "content": "Hello <|open|> & goodbye"}])
    assert ids.count(tok.token_to_id("<|open|>")) == 4  # only the structural ones
    segments = tok.chat_segments([{"role": "user", "content": "Hello <|open|> & goodbye"}])
    assert ids == [i for s in segments for i in tok.encode(s.text, allow_special=s.control)]
    assert ids != tok.encode(text, allow_special=True)  # segment boundaries change the ids


def test_multi_turn_with_tools_renders_by_the_rules(tok: KimiTokenizer) -> None:
    tools = [
        {
            "type": "function",
            "function": {"name": "get", "parameters": {"type": "object", "b": 1, "a": True}},
        }
    ]
    messages = [
        {"role": "system", "content": "  Be brief. "},
        {"role": "user", "content": "Weather?", "name": "ann"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Need tools.",
            "tool_calls": [
                {
                    "id": "c1",
                    "function": {"name": "get", "arguments": '{"city": "Paris", "days": 2}'},
                },
                {"id": "c2", "function": {"name": "now", "arguments": "not json"}},
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "c2",
            "content": "12:00",
        },  # out of order: normalised to c1, c2
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": 'Sunny & "warm".'},
    ]
    text = tok.render_chat(
        messages, tools=tools, tool_choice="required", response_format={"type": "json_object"}
    )

    def msg(role: str, body: str, **a: str) -> str:
        attrs = "".join(f' {k}="{v}"' for k, v in a.items())
        return f'<|open|>message role="{role}"{attrs}<|sep|>{body}<|close|>message<|sep|><|end_of_msg|>'

    def sysmsg(kind: str, body: str) -> str:
        return f'<|open|>message role="system" type="{kind}"<|sep|>{body}<|close|>message<|sep|><|end_of_msg|>'

    tools_json = '[{"function":{"name":"get","parameters":{"a":true,"b":1,"type":"object"}},"type":"function"}]'
    want = (
        sysmsg(
            "tool-declare",
            "# Tools\nHere are the available tools, described in JSONSchema.\n\n```json\n"
            + tools_json
            + "\n```",
        )
        + EFFORT_MAX
        + msg("system", "  Be brief. ")
        + msg("user", "Weather?", name="ann")
        + '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>Need tools.<|close|>think<|sep|>'
        "<|open|>response<|sep|>Checking.<|close|>response<|sep|><|open|>tools<|sep|>"
        '<|open|>call tool="get" index="1"<|sep|><|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
        '<|open|>argument key="days" type="number"<|sep|>2<|close|>argument<|sep|><|close|>call<|sep|>'
        '<|open|>call tool="now" index="2"<|sep|><|open|>json type="object"<|sep|>not json<|close|>json<|sep|><|close|>call<|sep|>'
        "<|close|>tools<|sep|><|close|>message<|sep|><|end_of_msg|>"
        + msg("tool", "sunny", tool="get", index=1)
        + msg("tool", "12:00", tool="now", index=2)
        + '<|open|>message role="assistant"<|sep|><|open|>think<|sep|><|close|>think<|sep|>'
        '<|open|>response<|sep|>Sunny & "warm".<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>'
        + sysmsg(
            "tool-choice",
            "The system is invoked with `tool_choice=required`.\nYou MUST call tools in the next message.",
        )
        + sysmsg(
            "response-format",
            "The system is invoked with `response_format=json_object`.\nYour response must be raw JSON "
            "data without markdown code blocks (```json) or any additional formatting.",
        )
        + '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>'
    )
    assert text == want


def test_attribute_escaping_thinking_off_and_effort_values(tok: KimiTokenizer) -> None:
    text = tok.render_chat([{"role": "user", "content": "x", "name": 'a&"b'}], thinking=False)
    assert (
        text
        == '<|open|>message role="user" name="a&amp;&quot;b"<|sep|>x<|close|>message<|sep|><|end_of_msg|><|open|>message role="assistant"<|sep|><|open|>response<|sep|>'
    )
    with pytest.raises(RequestError, match="thinking_effort"):
        tok.render_chat([{"role": "user", "content": "x"}], thinking_effort="medium")
    assert "thinking_effort=low" in tok.render_chat(
        [{"role": "user", "content": "x"}], thinking_effort="low"
    )
