"""Tools, structured output and turn-over-turn reuse on the real daemon (demo model), driven by the openai SDK.

SmolLM2-135M is far too weak to call tools or write schema-valid JSON by itself:
every valid answer here is the decoder's constraint at work. jsonschema is the
independent judge of validity.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

from tests.e2e.daemon_fixtures import Daemon

CONFIG = """
[server]
max_running = 4
max_tokens_default = 64
[cache]
expert_bytes = "1GiB"
"""
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast for a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time now",
            "parameters": {"type": "object", "properties": {}},
        },
    },
]
ASK = [{"role": "user", "content": "What's the weather in Paris for the next 3 days?"}]


@pytest.fixture(scope="module")
def daemon(demo_store: Path) -> Iterator[Daemon]:
    d = Daemon(demo_store, CONFIG).start()
    yield d
    d.stop()
    d.cleanup()


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    yield c
    c.close()


def test_required_tool_call_is_valid_streamed_and_not(client: openai.OpenAI) -> None:
    kw = dict(
        model="test-model",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=60,
    )
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name in ("get_weather", "get_time")
    schema = TOOLS[0 if call.function.name == "get_weather" else 1]["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    # Streamed: the id and name come first, then argument fragments; assembled, they equal the answer.
    chunks = list(client.chat.completions.create(**kw, stream=True))
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].id and calls[0].function.name == call.function.name and len(calls) > 2
    assert all(tc.index == 0 and tc.id is None for tc in calls[1:])
    assert "".join(tc.function.arguments or "" for tc in calls) == call.function.arguments
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_named_tool_choice_and_the_result_sent_back(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="test-model",
        messages=ASK,
        tools=TOOLS,
        temperature=0,
        max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER)
    history = [
        *ASK,
        r.choices[0].message.model_dump(exclude_none=True),
        {
            "role": "tool",
            "tool_call_id": call.id,
            "content": json.dumps({"forecast": "sunny", "high_c": 21}),
        },
    ]
    r2 = client.chat.completions.create(
        model="test-model", messages=history, tools=TOOLS, temperature=0, max_tokens=24
    )
    assert r2.choices[0].finish_reason in ("stop", "length") and "<tool_call>" not in (
        r2.choices[0].message.content or ""
    )
    # The sent-back call renders as the tokens generated: the prefix cache covers the whole first turn.
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached >= r.usage.prompt_tokens + r.usage.completion_tokens - 1


def test_agent_turns_reuse_the_whole_history_even_when_spelled_oddly(
    client: openai.OpenAI, demo_store: Path
) -> None:
    """Three turns of a tool-using agent: each prompt is served from the cache up to the last token
    the previous turn generated. Turn 1's call comes out in tokens BPE would not choose (asserted),
    which re-encoding the sent-back call would miss (a turn-2 miss once)."""
    from deltafind.tokenizer import Tokenizer

    tok = Tokenizer.load(demo_store / "tokenizer")
    tools = [
        {
            "type": "function",
            "function": {
                "name": "read_file",
                "description": "Read a file of the project",
                "parameters": {
                    "type": "object",
                    "properties": {"path": {"type": "string", "maxLength": 40}},
                    "required": ["path"],
                },
            },
        }
    ]
    msgs: list[dict] = [
        {"role": "system", "content": "You are a coding agent. Use the tools."},
        {"role": "user", "content": "Find out why test_parse fails."},
    ]
    prev = None
    for turn in range(3):
        r = client.chat.completions.create(
            model="test-model",
            messages=msgs,
            tools=tools,
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=48,
            logprobs=turn == 0,
        )
        if turn == 0:
            pieces = [t.token for t in r.choices[0].logprobs.content]
            assert pieces != [
                tok.decode([i])
                for i in tok.encode("".join(pieces), add_bos=False, allow_special=True)
            ]
        else:
            assert (
                r.usage.prompt_tokens_details.cached_tokens
                == prev.prompt_tokens + prev.completion_tokens - 1
            )
        prev = r.usage
        m = r.choices[0].message
        msgs += [
            m.model_dump(exclude_none=True),
            {
                "role": "tool",
                "tool_call_id": m.tool_calls[0].id,
                "content": '"def parse(s):\\n    return int(s)\\n"',
            },
        ]


# bounded fields: the 135M model, held to the schema, might else run out of tokens
class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population_millions: int = Field(ge=0, le=100)


def test_parse_with_pydantic_and_json_object(client: openai.OpenAI) -> None:
    r = client.chat.completions.parse(
        model="test-model",
        temperature=0,
        max_tokens=120,
        response_format=City,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
    )
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(
        model="test-model",
        temperature=0,
        max_tokens=60,
        response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "What's the weather in Paris for 3 days?"}],
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_bad_schemas_and_choices_are_400_naming_the_field(client: openai.OpenAI) -> None:
    bad = [
        (
            dict(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "strin"}},
                }
            ),
            "response_format.json_schema.schema",
        ),
        (
            dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
            "tool_choice.function.name",
        ),
        (
            dict(
                tools=[
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"a": {"$ref": "#/missing"}},
                            },
                        },
                    }
                ],
                tool_choice="required",
            ),
            "tools[0].function.parameters",
        ),
        (dict(tools=[{"type": "function"}]), "tools[0]"),
        (dict(tool_choice="required"), "tool_choice"),
    ]
    for extra, param in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="test-model", messages=ASK, max_tokens=4, **extra)
        assert e.value.body["param"] == param, (extra, e.value.body)


def _schemas() -> st.SearchStrategy[dict]:
    leaf = st.one_of(
        st.just({"type": "string", "maxLength": 12}),
        st.builds(
            lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
            st.integers(-50, 50),
            st.integers(0, 100),
        ),
        # no unbounded-precision numbers: a weak model can write 3.3333... until max_tokens, valid but cut off
        st.just({"type": "boolean"}),
        st.lists(
            st.sampled_from(["red", "green", "blue", "x y"]), min_size=1, max_size=3, unique=True
        ).map(lambda e: {"enum": e}),
        st.just(
            {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "maxItems": 3,
            }
        ),
    )
    names = st.from_regex(r"[a-z]{1,8}", fullmatch=True)

    def obj(children: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
        return st.dictionaries(names, children, min_size=1, max_size=3).flatmap(
            lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
                lambda req: {"type": "object", "properties": props, "required": req}
            )
        )

    return obj(st.one_of(leaf, obj(leaf)))


@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
@given(schema=_schemas())
def test_required_calls_validate_against_generated_schemas(
    client: openai.OpenAI, schema: dict
) -> None:
    tools = [
        {
            "type": "function",
            "function": {"name": "record", "description": "Record the data", "parameters": schema},
        }
    ]
    r = client.chat.completions.create(
        model="test-model",
        messages=[{"role": "user", "content": "Record something."}],
        tools=tools,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=200,
    )
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
    jsonschema.validate(json.loads(r.choices[0].message.tool_calls[0].function.arguments), schema)
