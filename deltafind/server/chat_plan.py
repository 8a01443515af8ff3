"""From a chat request to what the engine and the answer need: prompt ids, constraint, output parser.

Owns the per-request decisions of tool calling, reasoning and structured output:
which tool format the model speaks (server/tools.py), whether it thinks
(`reasoning_effort`, `chat_template_kwargs`), the grammar that enforces a
`response_format` or a required/named call (server/structured.py) and the
`OutputParser` (server/output.py) each choice's text goes through. Shared by
/v1/chat/completions, /v1/responses and /v1/messages, which map onto OpenAI chat.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from deltafind.engine.constraint import ConstraintFactory
from deltafind.errors import DeltafindError, RequestError, StoreError
from deltafind.server.errors import ApiError, bad_request
from deltafind.server.output import OutputParser
from deltafind.server.structured import (
    Grammar,
    json_schema_grammar,
    lark_json,
    response_format_schema,
)
from deltafind.server.tools import (
    LLAMA3,
    ToolFormat,
    call_grammar,
    check_tool_choice,
    check_tools,
    pick_format,
    template_messages,
)

K3_THINK = ("<|open|>think<|sep|>", "<|close|>think<|sep|>")
K3_STRIP = ("<|open|>response<|sep|>", "<|close|>response<|sep|>", "<|close|>message<|sep|>", "<|end_of_msg|>")
THINK = ("<think>", "</think>")
# OpenAI reasoning_effort -> K3 thinking_effort (K3 takes low, high, max: `medium` rounds up to high).
K3_EFFORT = {"low": "low", "medium": "high", "high": "high", "max": "max"}


@dataclass
class ChatPlan:
    prompt_ids: list[int]
    constraint: ConstraintFactory | None
    make_parser: Callable[[], OutputParser] | None
    tool_choice: str
    history_end: int = 0  # prompt tokens up to the end of the history, when per-request messages follow it (K3)

    def respell(self, ids: list[int]) -> None:
        """Take `ids` (server/turns.py's re-spelling of the prompt's start) as the prompt; history_end follows."""
        tail = len(self.prompt_ids) - self.history_end
        keep = self.history_end and len(ids) >= tail and ids[len(ids) - tail :] == self.prompt_ids[self.history_end :]
        self.prompt_ids, self.history_end = ids, len(ids) - tail if keep else 0


def _thinking(body: Any, kwargs: dict[str, Any], k3: bool) -> tuple[bool, str | None]:
    """(thinking on, K3 effort) from reasoning_effort and chat_template_kwargs (enable_thinking / thinking)."""
    on = True
    for key in ("enable_thinking", "thinking"):
        if key in kwargs:
            if not isinstance(kwargs[key], bool):
                raise bad_request(f"chat_template_kwargs.{key}: must be true or false", f"chat_template_kwargs.{key}", "invalid_value")
            on = kwargs[key]
    effort = kwargs.get("thinking_effort", "max") if k3 else None
    if body.reasoning_effort in ("none", "minimal"):
        on = False
    elif body.reasoning_effort is not None and k3:
        effort = K3_EFFORT[body.reasoning_effort]
    return on, effort


def plan_chat(tokenizer: Any, body: Any, messages: list[dict[str, Any]], always_parse: bool = False) -> ChatPlan:
    """Render `messages` with the request's tools, reasoning and response format; build the constraint.

    `always_parse`: a parser even for plain text (the item-shaped APIs read every answer through one).
    """
    tools = check_tools(body.tools)
    mode, forced = check_tool_choice(body.tool_choice, tools)
    schema, field = response_format_schema(body.response_format or {})
    if schema is not None and mode == "required":
        raise bad_request("response_format: cannot be combined with a required or named tool_choice", "response_format",
                          "invalid_value")
    kwargs = dict(body.chat_template_kwargs or {})
    k3 = hasattr(tokenizer, "chat_segments")
    thinking, effort = _thinking(body, kwargs, k3)
    if (schema is not None or mode == "required") and not k3:
        thinking = False  # the grammar starts at the answer (K3's grammar starts at its think channel instead)
    fmt, native = pick_format(tokenizer)
    # Every tool is rendered whatever tool_choice says, so an agent's turns share one prompt prefix;
    # `use` is what the grammar may call.
    use = [t for t in tools if forced is None or t.name == forced]
    parallel = body.parallel_tool_calls is not False and forced is None
    try:
        if k3:
            tc = {"required": "required", "none": "none"}.get(mode) if tools else None
            args = dict(tools=[t.raw for t in tools] or None, thinking=thinking, thinking_effort=effort if thinking else None)
            ids = tokenizer.apply_chat_template(messages, tool_choice=tc, response_format=body.response_format, **args)
            history_end = _history_end(tokenizer, messages, ids, args) if tc or schema is not None else 0
            prompt_text = ""
        else:
            msgs = template_messages(messages, fmt, native, tools)
            extra = {k: v for k, v in kwargs.items() if k not in ("enable_thinking", "thinking")}
            extra.update(enable_thinking=thinking, thinking=thinking)
            tpl_tools = [t.raw for t in tools] if native and tools else None
            prompt_text = tokenizer.render_chat(msgs, tools=tpl_tools, **extra)
            ids = tokenizer.apply_chat_template(msgs, tools=tpl_tools, **extra)
            history_end = 0  # HF templates put nothing per-request after the history: prompt + answer is the prefix
    except RequestError as e:  # the template refused this conversation (raise_exception)
        raise bad_request(str(e), "messages", "invalid_messages") from None
    except StoreError as e:  # the store's template is broken, too slow or too big: not the client's fault
        raise ApiError(500, f"the served model's chat template failed: {e}", None, "chat_template_error") from None
    except DeltafindError as e:  # the model has no chat template: use /v1/completions
        raise bad_request(str(e), "messages", "invalid_messages") from None
    constraint = None
    if mode != "none" and schema is None:
        for t in use:  # each schema on its own first, so a 400 names the tool whose schema is unusable
            Grammar(tokenizer, json_schema_grammar(t.parameters, t.field), t.field)
    # K3 answers after its think channel (free text; special tokens end it) in its response channel.
    o, c, sep = (f"<[{tokenizer.token_to_id(m)}]>" for m in ("<|open|>", "<|close|>", "<|sep|>")) if k3 else ("", "", "")
    k3_answer = f'/(?s:.*)/ {c} "think" {sep} {o} "response" {sep}' if k3 and thinking else ""
    if mode == "required":
        prefix = f'{k3_answer} /(?s:.*)/ {c} "response" {sep}' if k3 else ""
        constraint = Grammar(tokenizer, call_grammar(fmt, tokenizer, use, parallel, prefix), "tools").factory()
    elif schema is not None:
        grammar = f"start: {k3_answer} {lark_json(schema)}" if k3 else json_schema_grammar(schema, field)
        constraint = Grammar(tokenizer, grammar, field).factory()
    elif mode == "auto" and use and fmt is not LLAMA3:  # free text, but a call once started is valid
        grammar = Grammar(tokenizer, call_grammar(fmt, tokenizer, use, parallel), "tools")
        constraint = grammar.triggered_factory(tokenizer, fmt.start)
    think = None
    in_think = False
    if k3:
        think, in_think = K3_THINK, thinking
    elif THINK[1] in tokenizer.chat_template_source:
        think = THINK
        tail = prompt_text.rstrip()
        in_think = tail.rfind(THINK[0]) > tail.rfind(THINK[1])
    parse_tools: ToolFormat | None = fmt if tools else None
    strip = K3_STRIP if k3 else ()
    make_parser = None
    if parse_tools is not None or think is not None or k3 or always_parse:
        def make_parser() -> OutputParser:
            return OutputParser(parse_tools, think, in_think, strip)
    return ChatPlan(ids, constraint, make_parser, mode, history_end)


def _history_end(tokenizer: Any, messages: list[dict[str, Any]], ids: list[int], args: dict[str, Any]) -> int:
    """Where K3's history ends in `ids`: the tool-choice and response-format messages (docs/kimi-k3-format.md §6.6) come after it.

    The next turn's prompt repeats the history but not those messages, so the engine keeps a
    prefix-cache checkpoint here (KDA state resumes only where it was stored)."""
    head = tokenizer.apply_chat_template(messages, add_generation_prompt=False, **args)
    return len(head) if 0 < len(head) < len(ids) and ids[: len(head)] == head else 0
