"""From a chat request to what the engine and the answer need: prompt ids, constraint, output parser.

Owns the per-request decisions of tool calling, reasoning and structured output:
the model's chat format (server/formats renders the prompt once, writes call
grammars), whether it thinks (`reasoning_effort`, `chat_template_kwargs`), the
grammar that enforces a `response_format` or a required/named call and the
`OutputParser` (server/output.py) each choice's text goes through. Shared by
/v1/chat/completions, /v1/responses and /v1/messages, which map onto OpenAI chat.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from deltafind.engine.constraint import ConstraintFactory
from deltafind.errors import DeltafindError, StoreError
from deltafind.server.errors import ApiError, bad_request
from deltafind.server.formats import Request, pick_format
from deltafind.server.output import OutputParser
from deltafind.server.structured import Grammar, json_schema_grammar, response_format_schema
from deltafind.server.tools import check_tool_choice, check_tools


@dataclass
class ChatPlan:
    prompt_ids: list[int]
    constraint: ConstraintFactory | None
    make_parser: Callable[[], OutputParser] | None
    tool_choice: str
    history_end: int = (
        0  # prompt tokens up to the end of the history, when per-request messages follow it (K3)
    )

    def respell(self, ids: list[int]) -> None:
        """Take `ids` (server/turns.py's re-spelling of the prompt's start) as the prompt; history_end follows."""
        tail = len(self.prompt_ids) - self.history_end
        keep = (
            self.history_end
            and len(ids) >= tail
            and ids[len(ids) - tail :] == self.prompt_ids[self.history_end :]
        )
        self.prompt_ids, self.history_end = ids, len(ids) - tail if keep else 0


def _thinking(body: Any, kwargs: dict[str, Any]) -> bool:
    """Thinking on or off, from reasoning_effort and chat_template_kwargs (enable_thinking / thinking)."""
    on = True
    for key in ("enable_thinking", "thinking"):
        if key in kwargs:
            if not isinstance(kwargs[key], bool):
                raise bad_request(
                    f"chat_template_kwargs.{key}: must be true or false",
                    f"chat_template_kwargs.{key}",
                    "invalid_value",
                )
            on = kwargs[key]
    return on and body.reasoning_effort not in ("none", "minimal")


def plan_chat(
    tokenizer: Any, body: Any, messages: list[dict[str, Any]], always_parse: bool = False
) -> ChatPlan:
    """Render `messages` with the request's tools, reasoning and response format in the model's chat format
    (server/formats); build the constraint.

    `always_parse`: a parser even for plain text (the item-shaped APIs read every answer through one).
    """
    tools = check_tools(body.tools)
    mode, forced = check_tool_choice(body.tool_choice, tools)
    schema, field = response_format_schema(body.response_format or {})
    if schema is not None and mode == "required":
        raise bad_request(
            "response_format: cannot be combined with a required or named tool_choice",
            "response_format",
            "invalid_value",
        )
    kwargs = dict(body.chat_template_kwargs or {})
    fmt = pick_format(tokenizer)
    thinking = _thinking(body, kwargs)
    if (schema is not None or mode == "required") and not fmt.think_under_grammar:
        thinking = False  # the grammar starts at the answer
    # Every tool is rendered whatever tool_choice says, so an agent's turns share one prompt prefix;
    # `use` is what the grammar may call.
    use = [t for t in tools if forced is None or t.name == forced]
    parallel = body.parallel_tool_calls is not False and forced is None
    try:
        prompt = fmt.render(
            tokenizer,
            Request(
                messages, tools, mode, thinking, body.reasoning_effort, kwargs, body.response_format
            ),
        )
    except (
        StoreError
    ) as e:  # the store's template is broken, too slow or too big: not the client's fault
        raise ApiError(
            500, f"the served model's chat template failed: {e}", None, "chat_template_error"
        ) from None
    # the template refused this conversation (raise_exception, a RequestError), or the model has
    # no chat template (use /v1/completions)
    except DeltafindError as e:
        raise bad_request(str(e), "messages", "invalid_messages") from None
    constraint = None
    if mode != "none" and schema is None:
        for (
            t
        ) in use:  # each schema on its own first, so a 400 names the tool whose schema is unusable
            Grammar(tokenizer, json_schema_grammar(t.parameters, t.field), t.field)
    if mode == "required":
        prefix = fmt.answer_prefix(tokenizer, thinking, calls=True)
        constraint = Grammar(
            tokenizer, fmt.call_grammar(tokenizer, use, parallel, prefix), "tools"
        ).factory()
    elif schema is not None:
        constraint = Grammar(
            tokenizer, fmt.schema_grammar(tokenizer, thinking, schema, field), field
        ).factory()
    elif mode == "auto" and use and fmt.start:  # free text, but a call once started is valid
        grammar = Grammar(tokenizer, fmt.call_grammar(tokenizer, use, parallel), "tools")
        constraint = grammar.triggered_factory(tokenizer, fmt.start)
    think = fmt.think(tokenizer)
    make_parser = None
    if tools or think is not None or fmt.strip or always_parse:

        def make_parser() -> OutputParser:
            return OutputParser(fmt if tools else None, think, prompt.in_think, fmt.strip, tools)

    return ChatPlan(prompt.ids, constraint, make_parser, mode, prompt.history_end)
