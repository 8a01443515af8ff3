"""Forced tool calls per family: any token path the constraint allows parses back into a call whose
arguments validate (jsonschema), for Hermes, Llama 3, DeepSeek-V3, Kimi K2 and K3 XTML markup.

The walk picks uniformly among the allowed tokens, so it explores paths no model would take.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from deltafind.importer.synthetic_families import write_byte_tokenizer
from deltafind.server.chat_plan import plan_chat
from deltafind.server.errors import ApiError
from deltafind.tokenizer import Tokenizer
from deltafind.tokenizer.bpe import BYTE_TO_UNICODE
from deltafind.tokenizer.kimi import write_k3_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "hot": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b c"]}, "maxItems": 2},
        "where": {
            "type": "object",
            "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90}},
            "required": ["lat"],
        },
    },
    "required": ["city", "days", "where"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
    {
        "type": "function",
        "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}},
    },
]
FAMILIES = {
    "hermes": ([("<tool_call>", False), ("</tool_call>", False)], "{{ tools }}<tool_call>"),
    "llama3": (
        [("<|python_tag|>", True)],
        '{{ tools }}{"name": ..., "parameters": ...}<|python_tag|>',
    ),
    "deepseek_v3": (
        [
            (t, True)
            for t in (
                "<｜tool▁calls▁begin｜>",
                "<｜tool▁call▁begin｜>",
                "<｜tool▁sep｜>",
                "<｜tool▁call▁end｜>",
                "<｜tool▁calls▁end｜>",
            )
        ],
        "{{ tools }}",
    ),
    "kimi_k2": (
        [
            (t, True)
            for t in (
                "<|tool_calls_section_begin|>",
                "<|tool_call_begin|>",
                "<|tool_call_argument_begin|>",
                "<|tool_call_end|>",
                "<|tool_calls_section_end|>",
            )
        ],
        "{{ tools }}",
    ),
    "qwen3_coder": ([("<tool_call>", False), ("</tool_call>", False)], "{{ tools }}<function="),
}


def byte_tokenizer(folder: Path, added: list[tuple[str, bool]], marker: str) -> Tokenizer:
    tok = Backend(models.BPE(vocab={BYTE_TO_UNICODE[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|eos|>"])
    tok.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in added])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    template = (
        marker + "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|eos|>{% endfor %}"
    )
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|eos|>", "chat_template": template})
    )
    return Tokenizer.load(folder)


def body(**kw) -> SimpleNamespace:
    base = dict(
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        response_format=None,
        chat_template_kwargs=None,
        reasoning_effort=None,
    )
    return SimpleNamespace(**{**base, **kw})


def walk(tok: Tokenizer, plan, seed: int) -> list:
    rng = random.Random(seed)
    con = plan.constraint()
    ids: list[int] = []
    for _ in range(4000):
        if con.done:
            break
        allowed = con.allowed().nonzero().flatten().tolist()
        t = rng.choice(allowed)
        assert con.advance(t)
        if t in tok.eos_token_ids:
            break
        ids.append(t)
    parser = plan.make_parser()
    parser.feed(tok.decode(ids))
    parser.finish()
    return parser.tool_calls


@pytest.fixture(scope="module", params=[*FAMILIES, "kimi_k3"])
def family(request, tmp_path_factory) -> tuple[str, Tokenizer]:
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "kimi_k3":
        write_k3_tokenizer(folder)
        return request.param, Tokenizer.load(folder)
    added, marker = FAMILIES[request.param]
    return request.param, byte_tokenizer(folder, added, marker)


@pytest.mark.parametrize("seed", range(4))
def test_every_allowed_path_is_a_valid_call(family: tuple[str, Tokenizer], seed: int) -> None:
    name, tok = family
    plan = plan_chat(tok, body(), [{"role": "user", "content": "weather?"}])
    calls = walk(tok, plan, seed)
    assert len(calls) == 1, name
    schema = SCHEMA if calls[0].name == "get_weather" else TOOLS[1]["function"]["parameters"]
    jsonschema.validate(json.loads("".join(calls[0].arguments)), schema)


def test_named_choice_and_parallel_calls(family: tuple[str, Tokenizer]) -> None:
    name, tok = family
    named = body(tool_choice={"type": "function", "function": {"name": "noop"}})
    for seed in range(3):
        assert [
            c.name
            for c in walk(tok, plan_chat(tok, named, [{"role": "user", "content": "x"}]), seed)
        ] == ["noop"]
    if name != "llama3":  # Llama 3 writes one call per answer
        counts = [
            len(
                walk(
                    tok,
                    plan_chat(
                        tok, body(parallel_tool_calls=True), [{"role": "user", "content": "x"}]
                    ),
                    seed,
                )
            )
            for seed in range(6)
        ]
        assert min(counts) >= 1 and max(counts) >= 2, counts  # one or more, each parsed


def test_json_schema_response_format_and_bad_schemas(family: tuple[str, Tokenizer]) -> None:
    _, tok = family
    plan = plan_chat(
        tok,
        body(
            tools=None,
            tool_choice=None,
            response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}},
        ),
        [{"role": "user", "content": "x"}],
    )
    rng = random.Random(0)
    con = plan.constraint()
    ids = []
    while not con.done:
        t = rng.choice(con.allowed().nonzero().flatten().tolist())
        assert con.advance(t)
        if t in tok.eos_token_ids:
            break
        ids.append(t)
    text = tok.decode(ids)
    if plan.make_parser is not None:  # K3: a thought first, then the answer in the response channel
        parser = plan.make_parser()
        parser.feed(text)
        parser.finish()
        text = "".join(parser.content)
    jsonschema.validate(json.loads(text), SCHEMA)
    with pytest.raises(ApiError) as e:
        plan_chat(
            tok,
            body(
                tools=[
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}
                ]
            ),
            [],
        )
    assert e.value.param == "tools[0].function.parameters"


def test_auto_lets_text_run_then_enforces_a_started_call(family: tuple[str, Tokenizer]) -> None:
    name, tok = family
    if name == "llama3":
        pytest.skip("a Llama 3 call is the whole answer: no marker to trigger on")
    plan = plan_chat(tok, body(tool_choice="auto"), [{"role": "user", "content": "x"}])
    con = plan.constraint()
    marker = {
        "hermes": "<tool_call>",
        "deepseek_v3": "<｜tool▁calls▁begin｜>",
        "kimi_k2": "<|tool_calls_section_begin|>",
        "kimi_k3": "<|open|>tools<|sep|>",
        "qwen3_coder": "<tool_call>",
    }[name]
    before = (
        "Hmm.<|close|>think<|sep|><|open|>response<|sep|>Let me check.<|close|>response<|sep|>"
        if name == "kimi_k3"
        else "Let me check. "
    )
    prose = tok.encode(before, allow_special=True) + tok.encode(marker, allow_special=True)
    for t in prose:
        assert con.allowed() is None  # free text until the marker
        assert con.advance(t)
    rng = random.Random(1)
    ids = list(prose)
    while not con.done:
        t = rng.choice(con.allowed().nonzero().flatten().tolist())
        assert con.advance(t)
        if t in tok.eos_token_ids:
            break
        ids.append(t)
    parser = plan.make_parser()
    parser.feed(tok.decode(ids))
    parser.finish()
    assert "".join(parser.content).strip() == "Let me check."
    call = parser.tool_calls[0]
    jsonschema.validate(
        json.loads("".join(call.arguments)),
        SCHEMA if call.name == "get_weather" else {"type": "object"},
    )
    con.rollback(
        len(ids) - len(prose) + len(tok.encode(marker, allow_special=True))
    )  # back before the marker: free again
    assert con.allowed() is None and not con.done


@pytest.mark.parametrize("name", ["kimi_k3", "injected_hermes"])
def test_a_sent_back_call_renders_as_the_constrained_tokens(name: str, tmp_path: Path) -> None:
    """Turn 2's prompt = turn 1's prompt + the tokens turn 1 may generate: the prefix cache covers the history."""
    if name == "kimi_k3":
        write_k3_tokenizer(tmp_path)
        tok = Tokenizer.load(tmp_path)
    else:  # a template that knows no tools (the demo's kind): the Hermes prompt and markup are ours
        write_byte_tokenizer(tmp_path, {})
        tok = Tokenizer.load(tmp_path)
    args = {"city": "Paris", "days": 3, "where": {"lat": 48.85}}
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    # tool_choice auto: K3 renders "required" as a system message after the history, which no later turn repeats.
    turn1 = plan_chat(tok, body(tool_choice="auto"), ask)
    reply = {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Need the weather." if name == "kimi_k3" else None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps(args)},
            }
        ],
    }
    turn2 = plan_chat(
        tok,
        body(tool_choice="auto"),
        [
            *ask,
            {k: v for k, v in reply.items() if v is not None},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ],
    )
    n = len(turn1.prompt_ids)
    assert turn2.prompt_ids[:n] == turn1.prompt_ids
    con = turn1.constraint()
    generated = []
    # the rendered reply, token by token, is a path the constraint allows
    for t in turn2.prompt_ids[n:]:
        assert con.advance(t), tok.decode([*generated, t])
        generated.append(t)
        if con.done:
            break
    assert con.done
    parser = turn1.make_parser()
    parser.feed(tok.decode(generated))
    parser.finish()
    assert [json.loads("".join(c.arguments)) for c in parser.tool_calls] == [args]


@pytest.mark.parametrize(
    "kw",
    [
        dict(tool_choice="required"),
        dict(tool_choice="none"),
        dict(tools=None, tool_choice=None, response_format={"type": "json_object"}),
    ],
)
def test_k3_history_end_is_where_the_next_turn_leaves_this_prompt(kw: dict, tmp_path: Path) -> None:
    """K3 renders tool_choice required/none and response_format after the history (docs/kimi-k3-format.md §6.6): the
    plan says where the history ends, the next turn's prompt repeats exactly those ids, and the
    engine keeps a prefix-cache checkpoint there."""
    write_k3_tokenizer(tmp_path)
    tok = Tokenizer.load(tmp_path)
    ask = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
    ]
    turn1 = plan_chat(tok, body(**kw), ask)
    h = turn1.history_end
    assert 0 < h < len(turn1.prompt_ids)
    assert tok.decode(turn1.prompt_ids[h:]).startswith('<|open|>message role="system" type="')
    turn2 = plan_chat(
        tok,
        body(**kw),
        [
            *ask,
            {"role": "assistant", "content": "Sunny."},
            {"role": "user", "content": "And Rome?"},
        ],
    )
    assert turn2.prompt_ids[:h] == turn1.prompt_ids[:h]
    assert turn2.history_end > h and turn2.prompt_ids[h:] != turn1.prompt_ids[h:]
    assert (
        plan_chat(tok, body(tool_choice="auto"), ask).history_end == 0
    )  # nothing after the history: no checkpoint
    # a re-spelled start (server/turns.py) moves the history end with it; a changed tail drops it
    ids = turn1.prompt_ids
    turn1.respell([*ids[:2], 7, *ids[2:]])
    assert turn1.history_end == h + 1 and turn1.prompt_ids[h + 1 :] == ids[h:]
    turn1.respell([*turn1.prompt_ids[:-1], 5])
    assert turn1.history_end == 0


def test_hf_templates_need_no_checkpoint(family: tuple[str, Tokenizer]) -> None:
    name, tok = family
    plan = plan_chat(tok, body(), [{"role": "user", "content": "weather?"}])
    assert (plan.history_end > 0) == (name == "kimi_k3")


# Claude Code's and pydantic's schema habits: `$defs`/`$ref` (nested models) and `propertyNames`, which
# llguidance does not implement: enforced leniently (that keyword dropped, the rest kept).
NESTED = {
    "type": "object",
    "$defs": {
        "Place": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}},
            "required": ["city"],
        }
    },
    "properties": {
        "to": {"$ref": "#/$defs/Place"},
        "meta": {
            "type": "object",
            "propertyNames": {"pattern": "^[a-z]+$"},
            "additionalProperties": {"type": "string", "maxLength": 3},
            "maxProperties": 1,
        },
    },
    "required": ["to"],
}


@pytest.mark.parametrize("seed", range(3))
def test_defs_refs_and_unsupported_keywords_are_enforced_leniently(
    family: tuple[str, Tokenizer], seed: int
) -> None:
    name, tok = family
    tools = [{"type": "function", "function": {"name": "send", "parameters": NESTED}}]
    for choice in ("auto", "none"):  # nothing enforced until a call starts: accepted as sent
        plan_chat(tok, body(tools=tools, tool_choice=choice), [{"role": "user", "content": "x"}])
    (call,) = walk(tok, plan_chat(tok, body(tools=tools), [{"role": "user", "content": "x"}]), seed)
    args = json.loads("".join(call.arguments))
    checked = json.loads(json.dumps(NESTED).replace('"propertyNames"', '"x-not-enforced"'))
    jsonschema.validate(args, checked)
    assert call.name == "send" and isinstance(args["to"]["city"], str), name


def test_an_hf_template_renders_once_per_request(family: tuple[str, Tokenizer]) -> None:
    """The prompt's text (for an open think block) and its ids come from one rendering, not two."""
    name, tok = family
    if name == "kimi_k3":
        pytest.skip("K3's prompt is built by tokenizer/kimi_xtml.py, not a template")
    template = tok._template()
    renders = []
    real = template.render
    template.render = lambda *a, **kw: (
        renders.append(1) or real(*a, **kw)
    )  # counts, and renders for real
    try:
        plan_chat(tok, body(tool_choice="auto"), [{"role": "user", "content": "x"}])
    finally:
        del template.render
    assert len(renders) == 1


@pytest.mark.parametrize(
    "kw",
    [
        dict(tool_choice="required"),
        dict(tool_choice="none", reasoning_effort="none"),
        dict(tool_choice="auto", reasoning_effort="low"),
        dict(tools=None, tool_choice=None, response_format={"type": "json_object"}),
    ],
)
def test_k3_prompt_in_two_parts_is_the_whole_rendering(kw: dict, tmp_path: Path) -> None:
    """K3 renders its history and its per-request messages apart, each once: together they are the one
    rendering tokenizer/kimi.py makes of the whole conversation (checked against the reference by tests/oracle)."""
    write_k3_tokenizer(tmp_path)
    tok = Tokenizer.load(tmp_path)
    ask = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "noop", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "done"},
    ]
    b = body(**kw)
    plan = plan_chat(tok, b, ask)
    thinking = b.reasoning_effort != "none"
    tc = {"required": "required", "none": "none"}.get(b.tool_choice) if b.tools else None
    effort = {"low": "low"}.get(b.reasoning_effort or "", "max") if thinking else None
    whole = tok.apply_chat_template(
        ask,
        tools=b.tools,
        tool_choice=tc,
        response_format=b.response_format,
        thinking=thinking,
        thinking_effort=effort,
    )
    assert plan.prompt_ids == whole
