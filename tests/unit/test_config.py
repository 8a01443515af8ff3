"""deltafind.config: the generated example, precedence, byte sizes, error messages, reload keys."""

from __future__ import annotations

import argparse
import re
import runpy
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

import deltafind.config.load as load_mod
from deltafind.config import (
    ByteSize,
    FileMode,
    Settings,
    changed_keys,
    is_live,
    load_settings,
    render_example_toml,
)
from deltafind.daemon.service import install
from deltafind.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parents[2] / "etc" / "deltafind.toml"
REGENERATE = "run `make etc` (python -m deltafind.config > etc/deltafind.toml)"


@pytest.fixture(autouse=True)
def isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No DELTAFIND_* variables and no /etc file leak into a test."""
    import os

    for name in list(os.environ):
        if name.upper().startswith("DELTAFIND_"):
            monkeypatch.delenv(name)
    monkeypatch.setattr(load_mod, "DEFAULT_CONFIG_PATH", tmp_path / "absent" / "deltafind.toml")


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "deltafind.toml"
    path.write_text(text)
    return path


def config_error(path: Path, text: str) -> str:
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    return str(info.value)


def all_models() -> list[type[BaseModel]]:
    models: list[type[BaseModel]] = [Settings]
    for field in Settings.model_fields.values():
        inner = field.annotation
        inner = getattr(inner, "__args__", (inner,))[0]
        models.append(inner)
    return models


# -- the generated example ---------------------------------------------------


def test_example_file_is_up_to_date() -> None:
    assert EXAMPLE.read_text() == render_example_toml(), (
        f"etc/deltafind.toml is stale: {REGENERATE}"
    )


def test_example_file_loads_to_the_defaults() -> None:
    settings = load_settings(EXAMPLE)
    assert settings == Settings()
    assert settings.cache.expert_bytes == 4 * 2**30
    assert settings.control.mode == 0o600
    assert settings.drives == []


def test_example_shows_every_key_with_its_description() -> None:
    text = render_example_toml()
    for model in all_models():
        for key, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{key} has no description"
            line = rf"^(# )?\[\[?{key}\]\]?$" if model is Settings else rf"^(# )?{key} = "
            assert re.search(line, text, re.M), f"{key} missing from the example"
            first_words = " ".join(field.description.split()[:4])
            assert first_words in " ".join(text.replace("# ", " ").split())


def test_example_values_commented_out_are_valid(tmp_path: Path) -> None:
    # Uncommenting every example (None defaults, the [[drives]] table) must load
    # and set every key: the examples in the schema are real values.
    keys = "|".join(key for model in all_models()[1:] for key in model.model_fields)
    text = re.sub(
        rf"^# (\[\[drives\]\]|(?:{keys}) = .*)$", r"\1", render_example_toml(), flags=re.M
    )
    settings = load_settings(write(tmp_path, text))
    assert len(settings.drives) == 1
    assert settings.drives[0].read_mb_s == 2000.0
    for section in Settings.model_fields:
        value = getattr(settings, section)
        items = value.model_dump().items() if isinstance(value, BaseModel) else [(section, value)]
        assert all(v is not None for _, v in items), f"[{section}] still has unset keys"


def test_python_m_prints_the_example(capsys: pytest.CaptureFixture[str]) -> None:
    runpy.run_module("deltafind.config", run_name="__main__")
    assert capsys.readouterr().out == render_example_toml()


# -- sources and precedence ----------------------------------------------------


def test_precedence_file_then_env_then_overrides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(
        tmp_path,
        '[model]\nname = "from-file"\nstore = "/file"\n'
        '[cache]\nexpert_bytes = "1GiB"\npin_bytes = "1MiB"\n[server]\nport = 1111\n',
    )
    monkeypatch.setenv("DELTAFIND_CACHE__EXPERT_BYTES", "2GiB")
    monkeypatch.setenv("DELTAFIND_SERVER__PORT", "2222")
    settings = load_settings(path, overrides={"server": {"port": 3333}, "model": {"store": "/cli"}})
    assert settings.cache.expert_bytes == 2 * 2**30  # env beats file
    assert settings.cache.pin_bytes == 2**20  # file beats default
    assert settings.server.port == 3333  # override beats env
    assert settings.model.store == Path("/cli")  # override beats file ...
    assert settings.model.name == "from-file"  # ... and merges with it, key by key
    assert settings.server.host == "127.0.0.1"  # default


def test_env_nested_keys_and_json_lists(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DELTAFIND_LOGGING__LEVEL", "DEBUG")
    monkeypatch.setenv("DELTAFIND_DEVICE__KIND", "cuda:1")
    monkeypatch.setenv("DELTAFIND_SERVER__API_KEYS", '["k1", "k2"]')
    monkeypatch.setenv("DELTAFIND_DRIVES", '[{"path": "/mnt/a", "read_mb_s": 500}]')
    monkeypatch.setenv("DELTAFIND_MODEL__STORE", "")  # empty = unset (systemd EnvironmentFile)
    settings = load_settings()
    assert settings.model.store is None
    assert settings.logging.level == "debug"
    assert settings.device.kind == "cuda:1"
    assert settings.server.api_keys == ["k1", "k2"]
    assert settings.drives[0].path == Path("/mnt/a")
    assert settings.drives[0].read_mb_s == 500.0
    assert settings.drives[0].queue_depth == 8


def test_none_overrides_are_unset_flags(tmp_path: Path) -> None:
    path = write(tmp_path, '[model]\nstore = "/file"\n')
    settings = load_settings(path, overrides={"model": {"store": None}, "server": {"port": None}})
    assert settings.model.store == Path("/file")
    assert settings.server.port == 8000


def test_default_path_is_read_when_it_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert load_settings() == Settings()  # absent: built-in defaults
    monkeypatch.setattr(load_mod, "DEFAULT_CONFIG_PATH", write(tmp_path, "[server]\nport = 9000\n"))
    assert load_settings().server.port == 9000
    assert load_settings(str(write(tmp_path, "[server]\nport = 9001\n"))).server.port == 9001


def test_config_path_is_the_one_rule_serve_and_service_install_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert load_mod.config_path(None) is None  # no default file: built-in defaults
    assert load_mod.config_path("x.toml") == Path("x.toml")
    default = write(tmp_path, "[server]\nport = 9000\n")
    monkeypatch.setattr(load_mod, "DEFAULT_CONFIG_PATH", default)
    assert load_mod.config_path(None) == default
    args = argparse.Namespace(
        platform="linux", config=None, user=True, output=None, print_only=True
    )
    assert str(default) in install(args)[0]  # the unit runs the default file when there is one


def test_settings_are_frozen() -> None:
    settings = load_settings()
    with pytest.raises(ValidationError):
        settings.server.port = 1  # type: ignore[misc]
    with pytest.raises(ValidationError):
        settings.cache = settings.cache  # type: ignore[misc]


def test_api_keys_stay_out_of_repr(tmp_path: Path) -> None:
    settings = load_settings(overrides={"server": {"api_keys": ["sk-very-secret"]}})
    assert "sk-very-secret" not in repr(settings)


def test_json_schema_carries_live_marks() -> None:
    schema = Settings.model_json_schema()
    assert schema["$defs"]["CacheSettings"]["properties"]["expert_bytes"]["live"] is True
    assert "live" not in schema["$defs"]["ModelSettings"]["properties"]["store"]


# -- value types ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512", 512),
        ("64MiB", 64 * 2**20),
        ("8GiB", 8 * 2**30),
        ("8gib", 8 * 2**30),
        ("1.5GB", 1_500_000_000),
        ("1.5KiB", 1536),
        (" 3 MB ", 3_000_000),
        ("2k", 2000),
        ("2Ki", 2048),
        ("10B", 10),
        ("1TiB", 2**40),
        (".5MB", 500_000),
        ("0", 0),
        (0, 0),
        (4096, 4096),
        (2.0, 2),
    ],
)
def test_byte_size_parses(text: object, expected: int) -> None:
    assert ByteSize(text) == expected
    assert isinstance(ByteSize(text), int)


@pytest.mark.parametrize(
    "bad",
    [
        "lots",
        "-1",
        -1,
        "1.5",
        "1.0001KiB",
        "8XB",
        "",
        "GiB",
        "8 GiB 2",
        True,
        None,
        [1],
        0.5,
        2**63,
    ],
)
def test_byte_size_rejects(bad: object, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="expected a byte size like 8GiB or an integer"):
        ByteSize(bad)
    if bad is not None:  # a None override means "flag not given"
        with pytest.raises(
            ConfigError, match=r"^override: cache\.expert_bytes: expected a byte size"
        ):
            load_settings(overrides={"cache": {"expert_bytes": bad}})


@pytest.mark.parametrize(
    ("value", "human"),
    [(4 * 2**30, "4GiB"), (2**20, "1MiB"), (1_500_000_000, "1500MB"), (1023, "1023"), (0, "0")],
)
def test_byte_size_renders(value: int, human: str) -> None:
    assert ByteSize(value).human() == human


@given(st.integers(min_value=0, max_value=2**62))
def test_byte_size_round_trips(n: int) -> None:
    assert ByteSize(ByteSize(n).human()) == n


@pytest.mark.parametrize(
    ("value", "mode"), [("0600", 0o600), ("0o660", 0o660), ("640", 0o640), (0o750, 0o750), ("0", 0)]
)
def test_file_mode_parses(value: object, mode: int) -> None:
    assert FileMode(value) == mode


@pytest.mark.parametrize("bad", [600, "0800", "01777", -1, True, "rw-", 0o1000])
def test_file_mode_rejects(bad: object) -> None:
    with pytest.raises(ValueError, match="expected a file mode from 0 to 0o777"):
        FileMode(bad)


# -- errors ----------------------------------------------------------------------


def test_bad_byte_size_message_is_exact(tmp_path: Path) -> None:
    path = tmp_path / "deltafind.toml"
    message = config_error(path, '[cache]\nexpert_bytes = "lots"\n')
    assert (
        message
        == f"{path}: cache.expert_bytes: expected a byte size like 8GiB or an integer (got 'lots')"
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # wrong type
        ('[server]\nport = "eighty"\n', ["server.port: expected an integer", "(got 'eighty')"]),
        (
            '[prefetch]\nenabled = "maybe"\n',
            ["prefetch.enabled: expected true or false", "(got 'maybe')"],
        ),
        ("cache = 5\n", ["cache: expected a table ([cache] in TOML)", "(got 5)"]),
        # out of range
        (
            "[draft]\nmax_width = 17\n",
            ["draft.max_width: expected an integer from 1 to 16", "(got 17)"],
        ),
        ("[server]\nport = 70000\n", ["server.port: expected an integer from 0 to 65535"]),
        (
            "[cache]\nheat_decay = 0\n",
            ["cache.heat_decay: expected a number greater than 0 and at most 1"],
        ),
        (
            '[cache]\nexpert_bytes = "1GiB"\npin_bytes = "2GiB"\n',
            ["cache.pin_bytes: expected at most cache.expert_bytes (1GiB)", "(got '2GiB')"],
        ),
        (
            "[control]\nmode = 600\n",
            ['control.mode: expected a file mode from 0 to 0o777', '"0600"', "(got 600)"],
        ),
        # unknown key / section: name it and list the valid ones
        (
            '[cache]\nexpert_byte = "1GiB"\n',
            [
                "cache.expert_byte: unknown key; valid keys in [cache]: "
                "expert_bytes, pin_bytes, spine_bytes, heat_decay, heat_save_s, read_mode, prompt_bytes, "
                "prompt_snapshot_tokens, prompt_disk_bytes, prompt_disk_dir, spine_int8 (got '1GiB')"
            ],
        ),
        (
            "[servr]\nport = 1\n",
            [
                "servr: unknown section; valid sections: model, drives, device, cache, prefetch, draft, server, control, logging"
            ],
        ),
        (
            '[[drives]]\npath = "/a"\nspeed = 3\n',
            ["drives[0].speed: unknown key; valid keys in [drives]: path, read_mb_s, queue_depth"],
        ),
        # bad enum: list what is allowed
        (
            '[logging]\nformat = "xml"\n',
            ["logging.format: expected one of 'auto', 'json' or 'console'", "(got 'xml')"],
        ),
        ('[draft]\nmode = "maybe"\n', ["draft.mode: expected one of 'off', 'auto' or 'on'"]),
        (
            '[device]\nkind = "cuda:x"\n',
            [
                "device.kind: expected auto, cpu, cuda, cuda:N (N = GPU index) or mps",
                "(got 'cuda:x')",
            ],
        ),
        # lists of tables
        ("[[drives]]\nqueue_depth = 4\n", ["drives[0].path: required key is missing"]),
        (
            '[[drives]]\npath = "/a"\n[[drives]]\npath = "/a"\n',
            ["drives: expected each drive once; '/a' is listed twice"],
        ),
        (
            '[[drives]]\npath = "/a"\nread_mb_s = -5\n',
            ["drives[0].read_mb_s: expected a number greater than 0", "(got -5)"],
        ),
    ],
)
def test_bad_file_names_file_key_value_and_allowed(
    tmp_path: Path, text: str, expected: list[str]
) -> None:
    path = tmp_path / "deltafind.toml"
    message = config_error(path, text)
    assert message.startswith(f"{path}: ")
    assert "\n" not in message
    for part in expected:
        assert part in message


def test_one_line_per_problem(tmp_path: Path) -> None:
    path = tmp_path / "deltafind.toml"
    message = config_error(
        path, '[server]\nport = -1\nmax_running = 0\n[logging]\nlevel = "loud"\n'
    )
    lines = message.splitlines()
    assert len(lines) == 3
    assert all(line.startswith(f"{path}: ") for line in lines)
    assert [line.split(": ")[1] for line in lines] == [
        "server.port",
        "server.max_running",
        "logging.level",
    ]


def test_api_keys_are_not_echoed_in_errors(tmp_path: Path) -> None:
    message = config_error(tmp_path / "deltafind.toml", '[server]\napi_keys = "sk-very-secret"\n')
    assert "server.api_keys: expected a list" in message
    assert "sk-very-secret" not in message


def test_toml_syntax_error_names_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "deltafind.toml"
    message = config_error(path, '[server]\nport = 80\nhost = \n')
    assert message.startswith(f"{path}: line 3, column 8: invalid TOML: ")


def test_missing_and_unreadable_files(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(missing))}: config file not found$"):
        load_settings(missing)
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(tmp_path))}: cannot read config file"):
        load_settings(tmp_path)
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(b'[model]\nname = "caf\xe9"\n')
    with pytest.raises(ConfigError, match="invalid TOML: not UTF-8"):
        load_settings(latin1)
    assert ConfigError.exit_code == 2


def test_errors_name_the_env_variable_or_override(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write(tmp_path, '[server]\nport = 8080\n[cache]\nexpert_bytes = "lots"\n')
    monkeypatch.setenv("DELTAFIND_SERVER__PORT", "http")
    monkeypatch.setenv("DELTAFIND_CACHE__BOGUS", "1")
    with pytest.raises(ConfigError) as info:
        load_settings(path, overrides={"draft": {"max_width": 99}})
    lines = str(info.value).splitlines()
    assert "override: draft.max_width: expected an integer from 1 to 16 (got 99)" in lines
    assert (
        "environment variable DELTAFIND_SERVER__PORT: server.port: expected an integer (got 'http')"
        in lines
    )
    assert any(
        line.startswith("environment variable DELTAFIND_CACHE__BOGUS: cache.bogus: unknown key")
        for line in lines
    )
    assert any(line.startswith(f"{path}: cache.expert_bytes: ") for line in lines)


def test_env_json_error_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DELTAFIND_SERVER__API_KEYS", "k1,k2")
    with pytest.raises(
        ConfigError, match=r"^environment variables DELTAFIND_SERVER__API_KEYS: .*JSON"
    ):
        load_settings()


# -- reload ------------------------------------------------------------------------


def test_changed_keys_splits_live_from_restart() -> None:
    old = load_settings()
    new = load_settings(
        overrides={
            "cache": {"expert_bytes": "8GiB"},
            "server": {"api_keys": ["k"], "port": 9000},
            "logging": {"level": "debug"},
            "model": {"store": "/other"},
            "drives": [{"path": "/mnt/b"}],
            "device": {"kind": "cpu"},
        }
    )
    assert changed_keys(old, new) == (
        ["cache.expert_bytes", "server.api_keys", "logging.level"],
        ["model.store", "drives", "device.kind", "server.port"],
    )
    assert changed_keys(old, load_settings()) == ([], [])


def test_live_marks_follow_the_design() -> None:
    fields = {
        f"{section}.{key}": field
        for section, sf in Settings.model_fields.items()
        if isinstance(sf.annotation, type) and issubclass(sf.annotation, BaseModel)
        for key, field in sf.annotation.model_fields.items()
    }
    live = {key for key, field in fields.items() if is_live(field)}
    assert {k for k in fields if k.startswith("prefetch.")} <= live
    assert {"cache.expert_bytes", "cache.pin_bytes", "draft.mode", "draft.max_width"} <= live
    assert {"server.api_keys", "server.api_key_file", "server.max_queue", "logging.level"} <= live
    restart = set(fields) - live
    assert {k for k in fields if k.split(".")[0] in ("model", "device", "control")} <= restart
    assert {"server.host", "server.port", "server.unix_socket", "logging.format"} <= restart


def test_each_setting_has_one_name_in_toml_python_and_cli_and_the_old_names_are_gone(
    tmp_path: Path,
) -> None:
    from deltafind.cli import build_parser
    from deltafind.compose import settings_with

    assert settings_with(None, tmp_path, {"expert_bytes": 123}).cache.expert_bytes == 123
    with pytest.raises(TypeError, match="expert_cache_bytes"):
        settings_with(None, tmp_path, {"expert_cache_bytes": 123})
    assert build_parser().parse_args(["run", "--expert-bytes", "2KiB"]).expert_bytes == 2048
    with pytest.raises(SystemExit):
        build_parser().parse_args(["run", "--cache-bytes", "2KiB"])
    # The Python API's pin tier may sit beside an LRU smaller than it (a file may not: test above).
    pinned = settings_with(None, tmp_path, {"expert_bytes": 0, "pin_bytes": 1000})
    assert pinned.cache.pin_bytes == 1000 and pinned.cache.expert_bytes == 0
