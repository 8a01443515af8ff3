"""The README's copy-paste client examples (openai, openai-agents, LangChain, anthropic, curl) run as
written against `deltafind serve --store <demo>` (the model is named after the store folder, `demo`),
each in its own process; only the port is changed. Each must exit 0 and print what its comment promises."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.daemon_fixtures import Daemon

README = Path(__file__).resolve().parents[2] / "README.md"
CLIENTS = ["openai", "openai-agents", "LangChain", "anthropic", "curl"]


def examples(port: int) -> dict[str, tuple[str, str]]:
    """client -> (language, code) of each example in the README's agents section, pointed at `port`."""
    text = README.read_text()
    section = text[text.index("### Agents and chat UIs") :]
    section = section[: section.index("\n## ")]
    found = re.findall(r"\*\*([\w-]+)\*\*[^\n]*\n\n```(python|sh)\n(.*?)```", section, re.S)
    return {
        name: (lang, code.replace("localhost:8000", f"127.0.0.1:{port}"))
        for name, lang, code in found
    }


@pytest.fixture(scope="module")
def served(demo_store: Path):
    d = Daemon(demo_store)
    d.config.write_text(
        f'[model]\nstore = "{demo_store}"\n'
    )  # as the README runs it: no name, the folder's
    d.start()
    yield d
    d.stop()
    d.cleanup()


def test_every_client_has_an_example() -> None:
    assert sorted(examples(8000)) == sorted(CLIENTS)


@pytest.mark.parametrize("client", CLIENTS)
def test_readme_example_runs_as_written(served: Daemon, client: str) -> None:
    lang, code = examples(served.port)[client]
    cmd = (
        [sys.executable, "-c", code]
        if lang == "python"
        else ["bash", "-euo", "pipefail", "-c", code]
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{client} example failed:\n{proc.stdout}\n{proc.stderr}"
    out = proc.stdout
    if client == "openai":  # a call's arguments, a parsed model, a Responses text
        assert re.search(r'\{"city": ?"', out) and "name=" in out, out
    elif client == "LangChain":
        assert "'name': 'Forecast'" in out and "city=" in out, out
    elif client == "anthropic":
        assert out.startswith("tool_use [{"), out
    # a streamed forced call, then a JSON answer that parses (the schema closes it)
    elif client == "curl":
        assert '"tool_calls"' in out and '"finish_reason":"tool_calls"' in out.replace(" ", ""), out
        answer = json.loads(out.strip().splitlines()[-1])["choices"][0]["message"]["content"]
        assert set(json.loads(answer)) == {"name"}, answer
    else:
        assert out.strip(), out
