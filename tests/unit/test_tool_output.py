"""server/output.py with server/formats: reasoning, content and tool calls split from streamed text, for every family's markup."""

from __future__ import annotations

import json

import pytest

from deltafind.server.formats.deepseek_v3 import DEEPSEEK_V3
from deltafind.server.formats.hermes import HERMES
from deltafind.server.formats.kimi_k2 import KIMI_K2
from deltafind.server.formats.kimi_k3 import KIMI_K3 as K3_XTML
from deltafind.server.formats.llama3 import LLAMA3
from deltafind.server.output import OutputParser

K3_STRIP = (
    "<|open|>response<|sep|>",
    "<|close|>response<|sep|>",
    "<|close|>message<|sep|>",
    "<|end_of_msg|>",
)


def run(parser: OutputParser, text: str, step: int) -> tuple[str, str, list[dict]]:
    deltas = []
    for i in range(0, len(text), step):
        deltas += parser.feed(text[i : i + step])
    deltas += parser.finish()
    content = "".join(d.text for d in deltas if d.kind == "content")
    reasoning = "".join(d.text for d in deltas if d.kind == "reasoning")
    calls: dict[int, dict] = {}
    for d in deltas:
        if d.kind == "call":
            assert d.index not in calls, "a call starts once"
            calls[d.index] = {"name": d.text, "arguments": ""}
        elif d.kind == "args":
            calls[d.index]["arguments"] += d.text
    return content, reasoning, [calls[i] for i in sorted(calls)]


CASES = [
    (
        HERMES,
        None,
        False,
        (),
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris {x}", "n": [1, {"a": "}"}]}}\n</tool_call>\n'
        '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
        "Let me check.\n",
        [("get_weather", {"city": "Paris {x}", "n": [1, {"a": "}"}]}), ("now", {})],
    ),
    (
        LLAMA3,
        None,
        False,
        (),
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "",
        [("get_weather", {"city": "Paris"})],
    ),
    (LLAMA3, None, False, (), "{curly} text is not a call", "{curly} text is not a call", []),
    (
        DEEPSEEK_V3,
        None,
        False,
        (),
        "ok<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"a\": 1}\n```<｜tool▁call▁end｜>"
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>g\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "ok",
        [("f", {"a": 1}), ("g", {})],
    ),
    (
        KIMI_K2,
        None,
        False,
        (),
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"a\": \"b\"}"
        "<|tool_call_end|><|tool_calls_section_end|>",
        "",
        [("f", {"a": "b"})],
    ),
    (
        K3_XTML,
        ("<|open|>think<|sep|>", "<|close|>think<|sep|>"),
        True,
        K3_STRIP,
        'hmm, weather<|close|>think<|sep|><|open|>response<|sep|>Checking.<|close|>response<|sep|><|open|>tools<|sep|>'
        '<|open|>call tool="get_weather" index="1"<|sep|><|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>'
        '<|open|>argument key="days" type="number"<|sep|>3<|close|>argument<|sep|><|close|>call<|sep|>'
        '<|open|>call tool="f" index="2"<|sep|><|open|>json type="object"<|sep|>{"x": [1]}<|close|>json<|sep|><|close|>call<|sep|>'
        '<|close|>tools<|sep|><|close|>message<|sep|>',
        "Checking.",
        [("get_weather", {"city": "Paris", "days": 3}), ("f", {"x": [1]})],
    ),
    (
        HERMES,
        ("<think>", "</think>"),
        False,
        (),
        "<think>\nI should answer.\n</think>\n\nParis.",
        "Paris.",
        [],
    ),
]


@pytest.mark.parametrize("step", [1, 3, 1000])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_split_streamed_equals_whole(case: int, step: int) -> None:
    fmt, think, in_think, strip, text, want_content, want_calls = CASES[case]
    content, reasoning, calls = run(OutputParser(fmt, think, in_think, strip), text, step)
    assert content == want_content
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == want_calls
    if think and "</think>" in text:
        assert reasoning == "\nI should answer.\n"
    if fmt is K3_XTML:
        assert reasoning == "hmm, weather"
