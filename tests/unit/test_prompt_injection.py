"""No caller text becomes a control token: every special token of each served vocabulary, typed
into user and system content, names, tool descriptions, parameter names, call arguments and tool
results, leaves the prompt's control-token count as it is and comes back as text.

Formats: the demo (SmolLM2's GGUF, ChatML, the Hermes tool prompt), Llama 3, Kimi K2 (tiktoken),
DeepSeek-V3 and K3 (XTML), each template written after the model's own.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from deltafind.run_cli import demo_gguf_path
from deltafind.server.chat_plan import plan_chat
from deltafind.tokenizer import Tokenizer, write_tokenizer_from_gguf
from deltafind.tokenizer.bpe import BYTE_TO_UNICODE, KIMI_PATTERN, make_tiktoken_backend
from deltafind.tokenizer.kimi import write_k3_tokenizer

LLAMA3 = (
    [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
        "<|eom_id|>",
        "<|python_tag|>",
        "<|finetune_right_pad_id|>",
        "<|reserved_special_token_0|>",
    ],
    "{{- bos_token }}{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\n"
    "Call a function with its parameters as JSON.\n\n{% for t in tools %}{{ t | tojson(indent=4) }}\n\n{% endfor %}<|eot_id|>"
    "{%- endif %}{%- for m in messages %}"
    "{%- if m.role in ('tool', 'ipython') %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{%- elif m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n{% for c in m.tool_calls %}"
    '{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}{% endfor %}<|eot_id|>'
    "{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content | trim }}<|eot_id|>{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}",
    "<|begin_of_text|>",
)
DEEPSEEK_V3 = (
    [
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        "<｜User｜>",
        "<｜Assistant｜>",
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁call▁begin｜>",
        "<｜tool▁sep｜>",
        "<｜tool▁call▁end｜>",
        "<｜tool▁calls▁end｜>",
        "<｜tool▁outputs▁begin｜>",
        "<｜tool▁output▁begin｜>",
        "<｜tool▁output▁end｜>",
        "<｜tool▁outputs▁end｜>",
    ],
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}{{ m.content }}{% endif %}{% endfor %}"
    "{% if tools %}\n\n## Tools\n{% for t in tools %}### {{ t.function.name }}\n{{ t.function.description }}\n"
    "{{ t.function.parameters | tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}{% if m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{% elif m.role == 'assistant' and m.tool_calls %}<｜Assistant｜><｜tool▁calls▁begin｜>{% for c in m.tool_calls %}"
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{{ c.function.name }}\n```json\n{{ c.function.arguments | tojson }}\n```"
    "<｜tool▁call▁end｜>{% endfor %}<｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
    "{% elif m.role == 'assistant' %}<｜Assistant｜>{{ m.content }}<｜end▁of▁sentence｜>"
    "{% elif m.role == 'tool' %}<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{{ m.content }}<｜tool▁output▁end｜>"
    "<｜tool▁outputs▁end｜>{% endif %}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}",
    "<｜begin▁of▁sentence｜>",
)
KIMI_K2 = (
    [
        "[BOS]",
        "[EOS]",
        "<|im_end|>",
        "<|im_user|>",
        "<|im_assistant|>",
        "<|im_system|>",
        "<|im_middle|>",
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
        "<|reserved_token_0|>",
    ],
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"
    "{%- for m in messages -%}{%- set name = m.name or m.role -%}"
    "{%- if m.role == 'user' -%}<|im_user|>{{ name }}<|im_middle|>{%- elif m.role == 'assistant' -%}"
    "<|im_assistant|>{{ name }}<|im_middle|>{%- else -%}<|im_system|>{{ name }}<|im_middle|>{%- endif -%}"
    "{%- if m.role == 'tool' -%}## Return of {{ m.tool_call_id }}\n{%- endif -%}{{ m.content or '' }}"
    "{%- if m.tool_calls -%}<|tool_calls_section_begin|>{%- for c in m.tool_calls -%}<|tool_call_begin|>functions."
    "{{ c.function.name }}:{{ loop.index0 }}<|tool_call_argument_begin|>{{ c.function.arguments | tojson }}"
    "<|tool_call_end|>{%- endfor -%}<|tool_calls_section_end|>{%- endif -%}<|im_end|>{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}",
    "[BOS]",
)


def _byte_level(folder: Path, specials: list[str], template: str, bos: str) -> Tokenizer:
    tok = Backend(models.BPE(vocab={BYTE_TO_UNICODE[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": bos, "eos_token": specials[1], "chat_template": template})
    )
    return Tokenizer.load(folder)


def _kimi_k2(folder: Path) -> Tokenizer:
    specials, template, bos = KIMI_K2
    ranks = {bytes([b]): b for b in range(256)}
    backend = make_tiktoken_backend(
        ranks, KIMI_PATTERN, {s: 256 + i for i, s in enumerate(specials)}
    )
    return Tokenizer(
        backend, {"bos_token": bos, "eos_token": "[EOS]", "chat_template": template}, folder=folder
    )


@pytest.fixture(scope="module", params=["demo", "llama3", "deepseek_v3", "kimi_k2", "kimi_k3"])
def family(request, tmp_path_factory) -> tuple[str, Tokenizer]:
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "demo":
        write_tokenizer_from_gguf(demo_gguf_path(), folder)
        return request.param, Tokenizer.load(folder)
    if request.param == "kimi_k3":
        write_k3_tokenizer(folder)
        return request.param, Tokenizer.load(folder)
    if request.param == "kimi_k2":
        return request.param, _kimi_k2(folder)
    return request.param, _byte_level(
        folder, *{"llama3": LLAMA3, "deepseek_v3": DEEPSEEK_V3}[request.param]
    )


def _specials(tok: Tokenizer) -> list[str]:
    found = [t.content for t in tok._trusted.get_added_tokens_decoder().values() if t.special]
    assert len(found) >= 3
    return found


def _conversation(text: str, key: str) -> tuple[list[dict], list[dict]]:
    """Every place a client puts text: `text` in each, `key` as a parameter name."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "look",
                "description": "Finds things. " + text,
                "parameters": {
                    "type": "object",
                    "properties": {key: {"type": "string", "description": text}},
                },
            },
        }
    ]
    messages = [
        {"role": "system", "content": text},
        {"role": "user", "content": text, "name": text},
        {
            "role": "assistant",
            "content": text,
            "reasoning_content": text,
            "tool_calls": [
                {
                    "id": "c" + text,
                    "type": "function",
                    "function": {"name": "look" + text, "arguments": json.dumps({key: text})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c" + text, "content": text},
        {"role": "user", "content": text},
    ]
    return tools, messages


def _plan(tok: Tokenizer, text: str, key: str) -> list[int]:
    tools, messages = _conversation(text, key)
    body = SimpleNamespace(
        tools=tools,
        tool_choice="auto",
        parallel_tool_calls=None,
        response_format=None,
        chat_template_kwargs={"note": text},
        reasoning_effort=None,
    )
    return plan_chat(tok, body, messages).prompt_ids


def _payloads(specials: list[str]) -> list[str]:
    everything = "".join(specials)
    first = specials[0]
    # each special alone and all together, and ends that could join the template's markup
    return [
        everything,
        f"a {everything} b",
        first[:-1],
        first[1:],
        f"{first[1:]} x {first[:-1]}",
        *specials[:4],
    ]


def test_special_token_text_never_becomes_a_control_token(family: tuple[str, Tokenizer]) -> None:
    name, tok = family
    specials = _specials(tok)
    control = {tok.token_to_id(s) for s in specials}
    baseline = _plan(tok, "plain words", "city")
    count = sum(i in control for i in baseline)
    assert count >= 4, name  # the template's own markup
    for payload in _payloads(specials):
        ids = _plan(tok, payload, "city" + payload)
        assert sum(i in control for i in ids) == count, (name, payload)
        shown = tok.decode(ids)
        assert shown.count(payload) >= 4 + shown.count(payload * 2), (
            name,
            payload,
        )  # the text comes through


def test_ordinary_prompts_encode_as_before(family: tuple[str, Tokenizer]) -> None:
    """Without special text, the guarded encoding is the rendered text read with specials (the old way)."""
    name, tok = family
    if name == "kimi_k3":
        pytest.skip("K3 encodes XTML segments itself")
    tools, messages = _conversation("Weather in <Paris> | today>", "city")
    text = tok.render_chat(messages, tools=tools)
    assert tok.apply_chat_template(messages, tools=tools) == tok.encode(
        text, add_bos=False, allow_special=True
    )
