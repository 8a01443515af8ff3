"""Chat templates: where they are found, how they render, how they fail.

A tiny byte-level tokenizer stands in for a model; rendering is checked against
transformers' own renderer where it has one, else against literal expectations.
"""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import pytest

from deltafind.errors import DeltafindError, RequestError, StoreError
from deltafind.tokenizer import Tokenizer

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Café? 中文 ✓"},
    {"role": "assistant", "content": "Oui.", "reasoning": "they asked in French"},
    {"role": "user", "content": "Merci"},
]

# Exercises what transformers adds to jinja: loopcontrols, tojson (non-ASCII, indent),
# namespace, the {% generation %} tag, and the reasoning field aliases.
RICH_TEMPLATE = """{{ bos_token }}{% set ns = namespace(n=0) %}
{% for m in messages %}
{% if m.role == 'system' %}{% continue %}{% endif %}
{% set ns.n = ns.n + 1 %}
[{{ ns.n }}:{{ m.role }}] {{ m.content | tojson }}
{% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}
{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{{ eos_token }}{% endgeneration %}{% endif %}
{% if loop.index == 3 %}{% break %}{% endif %}
{% endfor %}
{{ {'k': 'ü', 'n': [1, 2]} | tojson(indent=2) }}
{% if add_generation_prompt %}[assistant]{% endif %}"""


def _tiny_store(folder: Path, config: dict | None = None, **files: str) -> Path:
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as Backend

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Backend(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in ("<s>", "</s>")]
    )
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    base = {"bos_token": "<s>", "eos_token": "</s>"}
    (folder / "tokenizer_config.json").write_text(json.dumps({**base, **(config or {})}))
    for name, text in files.items():
        (folder / name.replace("__", ".")).write_text(text)
    return folder


def test_rich_template_matches_transformers(tmp_path: Path) -> None:
    chat_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    tok = Tokenizer.load(_tiny_store(tmp_path / "s", {"chat_template": RICH_TEMPLATE}))
    for add in (True, False):
        rendered, _ = chat_utils.render_jinja_template(
            [MESSAGES],
            chat_template=RICH_TEMPLATE,
            add_generation_prompt=add,
            bos_token="<s>",
            eos_token="</s>",
        )
        assert tok.render_chat(MESSAGES, add_generation_prompt=add) == rendered[0]
    text = tok.render_chat(MESSAGES)
    assert '"Café? 中文 ✓"' in text and '"ü"' in text  # tojson keeps non-ASCII
    assert "<think>they asked in French</think>" in text
    assert text.startswith("<s>") and text.endswith("[assistant]")


def test_template_kwargs_and_strftime(tmp_path: Path) -> None:
    template = "{{ strftime_now('%Y') }}|{{ tools is none }}|{{ enable_thinking | default(true) }}"
    tok = Tokenizer.load(_tiny_store(tmp_path / "s", {"chat_template": template}))
    year, tools_none, thinking = tok.render_chat([]).split("|")
    assert len(year) == 4 and year.isdigit()
    assert tools_none == "True" and thinking == "True"
    assert tok.render_chat([], enable_thinking=False).endswith("|False")


def test_template_sources_in_order(tmp_path: Path) -> None:
    listed = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    assert (
        Tokenizer.load(_tiny_store(tmp_path / "a", {"chat_template": listed})).render_chat([])
        == "D"
    )
    both = _tiny_store(tmp_path / "b", {"chat_template": "CFG"}, chat_template__jinja="JINJA")
    assert Tokenizer.load(both).render_chat([]) == "CFG"
    jinja = _tiny_store(
        tmp_path / "c", chat_template__jinja="JINJA", chat_template__json='{"chat_template": "J"}'
    )
    assert Tokenizer.load(jinja).render_chat([]) == "JINJA"
    js = _tiny_store(tmp_path / "d", chat_template__json=json.dumps({"chat_template": "JSON"}))
    assert Tokenizer.load(js).render_chat([]) == "JSON"
    no_default = _tiny_store(
        tmp_path / "e", {"chat_template": [{"name": "tool_use", "template": "T"}]}
    )
    with pytest.raises(DeltafindError, match=r"tool_use.*no 'default'"):
        Tokenizer.load(no_default).render_chat([])


def test_missing_template_is_a_clear_error(tmp_path: Path) -> None:
    tok = Tokenizer.load(_tiny_store(tmp_path / "s"))
    assert not tok.has_chat_template
    assert tok.encode("still encodes") != []
    with pytest.raises(DeltafindError, match="no chat template"):
        tok.render_chat([{"role": "user", "content": "hi"}])


def test_template_errors_name_the_file(tmp_path: Path) -> None:
    broken = Tokenizer.load(
        _tiny_store(tmp_path / "a", chat_template__jinja="{% for m in messages %}")
    )
    with pytest.raises(DeltafindError, match=r"a/chat_template\.jinja.*does not compile"):
        broken.render_chat([])
    strict = "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}ok"
    tok = Tokenizer.load(_tiny_store(tmp_path / "b", {"chat_template": strict}))
    assert tok.render_chat([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(
        RequestError, match=r"b/tokenizer_config\.json.*first message must be user"
    ) as err:
        tok.render_chat([{"role": "assistant", "content": "x"}])
    assert err.value.param == "messages"
    failing = Tokenizer.load(
        _tiny_store(tmp_path / "c", {"chat_template": "{{ messages[0].content.upper(1, 2) }}"})
    )
    with pytest.raises(DeltafindError, match=r"c/tokenizer_config\.json.*failed"):
        failing.render_chat([{"role": "user", "content": "x"}])


def test_sandbox_blocks_internals(tmp_path: Path) -> None:
    template = "{{ messages.__class__.__mro__ }}{% set ns = namespace() %}{% set ns._x = 1 %}"
    tok = Tokenizer.load(_tiny_store(tmp_path / "s", {"chat_template": template}))
    with pytest.raises(DeltafindError):
        tok.render_chat([])


@pytest.mark.parametrize("add_bos_token", [True, False])
def test_apply_chat_template_bos_once(tmp_path: Path, add_bos_token: bool) -> None:
    emits = Tokenizer.load(
        _tiny_store(
            tmp_path / "a",
            {
                "chat_template": "{{ bos_token }}{{ messages[0].content }}",
                "add_bos_token": add_bos_token,
            },
        )
    )
    ids = emits.apply_chat_template([{"role": "user", "content": "hi"}])
    bos = emits.bos_token_id
    assert ids[0] == bos and ids.count(bos) == 1  # the template's own <s> is parsed as the token
    omits = Tokenizer.load(
        _tiny_store(
            tmp_path / "b",
            {"chat_template": "{{ messages[0].content }}", "add_bos_token": add_bos_token},
        )
    )
    ids = omits.apply_chat_template([{"role": "user", "content": "hi <s>"}])
    assert (ids[0] == bos) is add_bos_token
    assert ids.count(bos) == (1 if add_bos_token else 0)  # "<s>" typed in content stays text


@pytest.mark.parametrize(
    "template",
    [
        "{{ 'x'|center(300000000) }}",  # folded by jinja's compiler, once outside every bound
        "{% set x = 'x'|center(300000000) %}ok",  # built, never output
        "{{ messages[0].content.center(300000000) }}",  # a str method
        "{{ '%0300000000d' % 1 }}",
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
        "{{ messages|tojson(indent=300000000) }}",
    ],  # the time bound: test_daemon_hardening's "slow" template
)
def test_template_bounds_cover_compiling_filters_and_memory(tmp_path: Path, template: str) -> None:
    tok = Tokenizer.load(_tiny_store(tmp_path / "s", {"chat_template": template}))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    with pytest.raises(StoreError, match=r"s/tokenizer_config\.json.*(characters|ran over)"):
        tok.render_chat([{"role": "user", "content": "x"}])
    assert time.monotonic() - t0 < 8
    assert (
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 << 10
    )  # KiB: the build was elsewhere
