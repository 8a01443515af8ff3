"""server/formats/qwen3_coder.py: Qwen3-Coder's XML calls rendered by its template, enforced, parsed and streamed.

The template below writes calls the way Qwen3-Coder's does (`<tool_call>`, `<function=NAME>`, one
`<parameter=KEY>` block per argument, a string as written and anything else as JSON); it is the
independent side: what it renders must be a path the call grammar allows and parse back to the
arguments sent.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from deltafind.server.chat_plan import plan_chat
from deltafind.server.formats import pick_format
from deltafind.server.formats.qwen3_coder import QWEN3_CODER
from deltafind.tokenizer import Tokenizer
from deltafind.tokenizer.bpe import BYTE_TO_UNICODE

TEMPLATE = (  # (a newline right after a tag is trimmed, as transformers renders: those are written as {{ '\n' }})
    "{%- if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ '\\n' }}<function>\n<name>{{ t.function.name }}</name>"
    "</function>{% endfor %}{{ '\\n' }}</tools><|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.tool_calls %}<|im_start|>assistant{% for c in m.tool_calls %}{{ '\\n' }}<tool_call>\n<function={{ c.function.name }}>\n"
    "{% for k, v in c.function.arguments.items() %}<parameter={{ k }}>\n{{ v if v is string else v | tojson }}\n</parameter>\n"
    "{% endfor %}</function>\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SCHEMA = {
    "type": "object",
    "properties": {
        "path": {"type": "string"},
        "code": {"type": "string", "maxLength": 40},
        "line": {"type": "integer"},
        "mode": {"enum": ["w", "a"]},
        "opts": {"type": "object", "properties": {"dry": {"type": "boolean"}}},
    },
    "required": ["path", "code"],
}
TOOLS = [{"type": "function", "function": {"name": "write_file", "parameters": SCHEMA}}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("qwen3_coder")
    backend = Backend(models.BPE(vocab={BYTE_TO_UNICODE[b]: b for b in range(256)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    backend.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t in ("<tool_call>", "</tool_call>")]
    )
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "chat_template": TEMPLATE})
    )
    return Tokenizer.load(folder)


def body(**kw) -> SimpleNamespace:
    base = dict(
        tools=TOOLS,
        tool_choice="auto",
        parallel_tool_calls=True,
        response_format=None,
        chat_template_kwargs=None,
        reasoning_effort=None,
    )
    return SimpleNamespace(**{**base, **kw})


def test_a_sent_back_call_renders_as_the_constrained_tokens_and_parses_back(tok: Tokenizer) -> None:
    assert pick_format(tok) is QWEN3_CODER
    args = {
        "path": "a.py",
        "code": "if x < 1:\n    print('</p>')",
        "line": 3,
        "opts": {"dry": True},
    }
    ask = [{"role": "user", "content": "Write it."}]
    turn1 = plan_chat(tok, body(tool_choice="required", parallel_tool_calls=False), ask)
    reply = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "write_file", "arguments": json.dumps(args)},
            }
        ],
    }
    turn2 = plan_chat(
        tok, body(), [*ask, reply, {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    )
    n = len(turn1.prompt_ids)
    assert turn2.prompt_ids[:n] == turn1.prompt_ids
    rendered = tok.decode(turn2.prompt_ids[n:])
    assert rendered.startswith(
        '<tool_call>\n<function=write_file>\n<parameter=path>\na.py\n</parameter>\n'
    )
    con = turn1.constraint()
    generated = []
    # the template's rendering, token by token, is a path the call grammar allows
    for t in turn2.prompt_ids[n:]:
        if con.done:
            break
        assert con.advance(t), tok.decode([*generated, t])
        generated.append(t)
    assert con.done
    parser = turn1.make_parser()
    parser.feed(tok.decode(generated))
    parser.finish()
    assert [(c.name, json.loads("".join(c.arguments))) for c in parser.tool_calls] == [
        ("write_file", args)
    ]


def test_streamed_deltas_name_the_call_first_and_equal_the_whole(tok: Tokenizer) -> None:
    text = (
        "Writing both.\n<tool_call>\n<function=write_file>\n<parameter=path>\n123\n</parameter>\n<parameter=code>\n"
        "a\n\nb<c>\n</parameter>\n<parameter=line>\n7\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
        "<function=write_file>\n<parameter=path>\nb.py\n</parameter>\n<parameter=code>\n\n</parameter>\n</function>\n"
        "</tool_call>"
    )
    plan = plan_chat(tok, body(), [{"role": "user", "content": "x"}])
    results = []
    for step in (1, 5, len(text)):
        parser, deltas = plan.make_parser(), []
        for i in range(0, len(text), step):
            deltas += [(d.kind, d.text, d.index) for d in parser.feed(text[i : i + step])]
        deltas += [(d.kind, d.text, d.index) for d in parser.finish()]
        results.append((parser, deltas))
        kinds = [k for k, _, _ in deltas if k != "content"]
        assert kinds == [
            "call",
            "args",
            "call",
            "args",
        ]  # each call's name is sent before its arguments
        assert "".join(t for k, t, _ in deltas if k == "content") == "Writing both.\n"
    for (
        parser,
        _,
        # a string stays a string ("123"), an integer is read as one; inner blank lines kept
    ) in results:
        assert [json.loads("".join(c.arguments)) for c in parser.tool_calls] == [
            {"path": "123", "code": "a\n\nb<c>", "line": 7},
            {"path": "b.py", "code": ""},
        ]
    parser = plan.make_parser()  # a call split mid-header is announced as soon as its name is whole
    assert [d.kind for d in parser.feed("<tool_call>\n<function=write_fi")] == []
    assert [(d.kind, d.text) for d in parser.feed("le>\n<parameter=path>\nx")] == [
        ("call", "write_file")
    ]
