"""One name for each setting: its TOML key, or section_key where the key alone is ambiguous
(docs/configuration.md), in Model.open's keywords, the commands' flags and the options objects."""

from __future__ import annotations

import argparse
import builtins
import re
from collections import Counter
from dataclasses import fields
from pathlib import Path
from typing import get_args

import pytest

from deltafind.cli import build_parser
from deltafind.compose import scheduler_limits, server_config, settings_with
from deltafind.config import Settings
from deltafind.config.schema import python_names
from deltafind.daemon.cli import overrides_from
from deltafind.errors import ConfigError, StoreError
from deltafind.store.experts import prefetch_options

# The section forms (docs/configuration.md): one value, named after its section.
FORMS = {("device", "kind"): "device", ("prefetch", "enabled"): "prefetch"}
FORMS |= {("draft", "mode"): "draft", ("draft", "source"): "draft"}


def rule() -> dict[tuple[str, str], str]:
    """Every settings field walked from the schema, named by the rule as the docs page words it."""
    keys = {}
    for section, field in Settings.model_fields.items():
        cls = (get_args(field.annotation) or (field.annotation,))[0]
        keys[section] = list(cls.model_fields)
    counts = Counter(k for ks in keys.values() for k in ks)
    return {
        (s, k): FORMS.get((s, k))
        or (k if counts[k] == 1 and k not in dir(builtins) else f"{s}_{k}")
        for s, ks in keys.items()
        for k in ks
    }


def test_the_schema_names_each_setting_by_the_rule_and_no_two_alike() -> None:
    want = {name: sk for sk, name in rule().items() if sk not in FORMS}
    assert python_names() == want
    assert len(set(rule().values())) == len(rule()) - 1  # draft's two keys share one form


def test_model_open_takes_each_setting_by_its_python_name_only(tmp_path: Path) -> None:
    names = {sk: n for sk, n in rule().items() if sk[0] != "drives" and sk not in FORMS}
    for (section, key), name in names.items():
        default = getattr(getattr(Settings(), section), key)
        try:
            got = settings_with(None, tmp_path, {name: default})
        except (ConfigError, StoreError):
            continue  # a default such as None may not pass alone (a store is still named)
        assert getattr(getattr(got, section), key) == default, name
    s = settings_with(
        None,
        tmp_path,
        {"device": "cpu", "device_compile": True, "max_width": 3, "expert_bytes": 5, "threads": 2},
    )
    assert (s.device.kind, s.device.compile, s.draft.max_width) == ("cpu", True, 3)
    assert (s.cache.expert_bytes, s.device.threads, s.model.store) == (5, 2, tmp_path)
    with pytest.raises(TypeError, match=r"prefetch=.*max_in_flight="):
        settings_with(None, tmp_path, {"prefetch": prefetch_options(Settings())})
    for old in ("compile_kernels", "draft_max_width", "expert_cache_bytes", "kind", "compile"):
        with pytest.raises(TypeError, match=f"'{old}'.*docs/configuration.md"):
            settings_with(None, tmp_path, {old: 1})


def _settings_flags() -> list[tuple[str, argparse.Action, tuple[str, str]]]:
    """Each (command, flag, setting) whose help says it overrides `[section] key` or defaults to it."""
    keys = set(rule())
    commands = next(
        a.choices for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    )
    return [
        (command, flag, (s, k))
        for command, sub in commands.items()
        for flag in sub._actions
        for s, k in re.findall(r"(?:overrides|default:) \[(\w+)\] (\w+)", flag.help or "")
        if (s, k) in keys
    ]


def test_every_flag_that_sets_a_setting_is_spelled_as_its_python_name() -> None:
    found = _settings_flags()
    assert {c for c, _, _ in found} >= {"run", "bench", "serve", "node"}
    names = rule()
    for command, flag, setting in found:
        want = "--" + names[setting].replace("_", "-")
        assert flag.option_strings == [want], (command, flag.option_strings, setting)
    args = build_parser().parse_args(
        ["serve", "--server-port", "9", "--socket", "/x", "--host", "h"]
    )
    assert overrides_from(args) == {
        "model": {"store": None},
        "server": {"host": "h", "port": 9},
        "control": {"socket": "/x"},
    }


def test_options_built_from_several_sections_use_the_rule_names_and_one_section_its_keys() -> None:
    s = Settings(
        server={"max_running": 3, "max_queue": 5, "max_context": 777, "step_target_s": 0.25}
        | {"max_prefill_tokens": 64},
        cache={"prompt_bytes": 12345, "prompt_snapshot_tokens": 99},
        prefetch={"max_in_flight": 7, "recall_threshold": 0.42},
    )
    given = {
        3: "max_running",
        5: "max_queue",
        777: "max_context",
        0.25: "step_target_s",
        12345: "prompt_bytes",
        99: "prompt_snapshot_tokens",
    }
    limits = scheduler_limits(s, None, 1 << 20)
    seen = {given[v]: f.name for f in fields(limits) if (v := getattr(limits, f.name)) in given}
    assert seen == {n: n for n in given.values()}
    p = prefetch_options(s)
    assert (p.max_in_flight, p.recall_threshold) == (7, 0.42)
    assert {f.name for f in fields(server_config(s))} <= {
        n for (x, _), n in rule().items() if x == "server"
    }
