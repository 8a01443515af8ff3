"""Agent frameworks and other APIs against the real daemon (demo model): openai Responses, openai-agents,
LangChain, the anthropic SDK. Each client parses our wire format itself; jsonschema and the frameworks'
own parsers judge the answers."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.e2e import test_agents_openai as chat_tests
from tests.e2e.daemon_fixtures import Daemon
from tests.e2e.test_agents_openai import WEATHER

daemon, client = (
    chat_tests.daemon,
    chat_tests.client,
)  # the same fixtures: a demo daemon per module, its openai client
RESP_TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather forecast for a city",
        "parameters": WEATHER,
    }
]


def test_responses_text_tools_streaming_and_previous_id(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model="test-model",
        input="What is the capital of France?",
        max_output_tokens=12,
        temperature=0,
    )
    chat = client.chat.completions.create(
        model="test-model",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=12,
        temperature=0,
    )
    assert (
        r.output_text == chat.choices[0].message.content
        and r.usage.output_tokens == chat.usage.completion_tokens
    )
    r = client.responses.create(
        model="test-model",
        input="Weather in Paris for 3 days?",
        tools=RESP_TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=60,
        temperature=0,
    )
    (call,) = [o for o in r.output if o.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    with client.responses.stream(
        model="test-model",
        input="Weather in Paris for 3 days?",
        tools=RESP_TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=60,
        temperature=0,
    ) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    assert [o.arguments for o in final.output if o.type == "function_call"] == [call.arguments]
    # The tool's result, sent as a continuation of the kept response.
    r2 = client.responses.create(
        model="test-model",
        previous_response_id=r.id,
        max_output_tokens=8,
        temperature=0,
        tools=RESP_TOOLS,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}],
    )
    assert r2.output_text and r2.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens
    with pytest.raises(openai.NotFoundError):
        client.responses.create(
            model="test-model", previous_response_id="resp_nope", input="hi", max_output_tokens=2
        )


def test_openai_agents_runs_a_function_tool_to_completion(daemon: Daemon) -> None:
    agents = pytest.importorskip("agents")
    calls: list[dict] = []

    @agents.function_tool
    def get_weather(city: str, days: int) -> str:
        """Weather forecast for a city.

        Args:
            city: the city.
            days: how many days ahead.
        """
        calls.append({"city": city, "days": days})
        return f"Sunny in {city} for {days} days, 21 C."

    agents.set_tracing_disabled(True)
    model = agents.OpenAIResponsesModel(
        "test-model",
        openai.AsyncOpenAI(
            base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=300
        ),
    )
    agent = agents.Agent(
        name="forecaster",
        instructions="Use the tool, then answer.",
        tools=[get_weather],
        model=model,
        model_settings=agents.ModelSettings(
            tool_choice="required", temperature=0, max_tokens=40, parallel_tool_calls=False
        ),
    )
    result = agents.Runner.run_sync(
        agent, "What's the weather in Paris for the next 3 days?", max_turns=4
    )
    assert calls and isinstance(calls[0]["city"], str) and isinstance(calls[0]["days"], int)
    outputs = [i for i in result.new_items if i.type == "tool_call_output_item"]
    assert outputs and outputs[0].output.startswith("Sunny in")
    # The agent's next turn saw the tool result: its final answer came from a model call after the tool ran.
    assert isinstance(result.final_output, str) and len(result.raw_responses) >= 2


class Forecast(BaseModel):
    city: str
    days: int


def test_langchain_bind_tools_and_structured_output(daemon: Daemon) -> None:
    lc = pytest.importorskip("langchain_openai")
    llm = lc.ChatOpenAI(
        model="test-model",
        base_url=daemon.url + "/v1",
        api_key="unused",
        temperature=0,
        max_tokens=60,
        max_retries=0,
        timeout=300,
    )
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather forecast",
            "parameters": WEATHER,
        },
    }
    msg = llm.bind_tools([tool], tool_choice="get_weather").invoke("Weather in Paris for 3 days?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(msg.tool_calls[0]["args"], WEATHER)
    out = llm.with_structured_output(Forecast).invoke("Forecast for Paris, 3 days, as JSON.")
    assert isinstance(out, Forecast)


def test_anthropic_messages_text_tools_streaming_and_errors(daemon: Daemon) -> None:
    a = anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0, timeout=300)
    t0 = {"extra_body": {"temperature": 0}}
    m = a.messages.create(
        model="test-model",
        max_tokens=12,
        system="Be brief.",
        messages=[{"role": "user", "content": "Hi!"}],
        **t0,
    )
    assert (
        m.content[0].type == "text"
        and m.content[0].text
        and m.stop_reason in ("end_turn", "max_tokens")
    )
    tools = [{"name": "get_weather", "description": "Weather forecast", "input_schema": WEATHER}]
    ask = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
    m = a.messages.create(
        model="test-model",
        max_tokens=60,
        messages=ask,
        tools=tools,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        **t0,
    )
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and use.name == "get_weather"
    jsonschema.validate(use.input, WEATHER)
    with a.messages.stream(
        model="test-model",
        max_tokens=60,
        messages=ask,
        tools=tools,
        tool_choice={"type": "tool", "name": "get_weather"},
        **t0,
    ) as s:
        streamed = s.get_final_message()
    assert [b.input for b in streamed.content if b.type == "tool_use"] == [use.input]
    history = [
        *ask,
        {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"}],
        },
    ]
    m2 = a.messages.create(model="test-model", max_tokens=10, messages=history, tools=tools, **t0)
    assert m2.content and m2.usage.cache_read_input_tokens >= m.usage.input_tokens
    with pytest.raises(anthropic.BadRequestError) as e:
        a.messages.create(
            model="test-model",
            max_tokens=4,
            messages=ask,
            tools=[{"name": "f", "input_schema": {"type": "strin"}}],
            tool_choice={"type": "any"},
        )
    assert (
        e.value.body["type"] == "error"
        and "tools[0].function.parameters" in e.value.body["error"]["message"]
    )
    a.close()
