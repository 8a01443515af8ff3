"""Run the real Codex CLI (npm @openai/codex, pinned) against a live daemon, through a logging proxy.

`codex_bin()` installs the pinned CLI into a cached npm folder (None without node/npm);
`run_codex` writes a CODEX_HOME with a `model_providers` entry (telemetry, update
checks and history off) and runs one `codex exec`. `python -m tests.e2e.codex_cli
STORE NAME` records a session's requests as tests/data/agents/codex-NAME.json.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.e2e.agent_proxy import FIXTURES, LoggingProxy, Reply, npm_cli

CODEX_VERSION = "0.171.0"
# The user's config the test uses: only documented keys (developers.openai.com/codex/config-reference). Sub-agent
# and goal tools and web search off: its prompt on the demo's tokenizer goes from ~5.5k tokens to ~2k, a CI-sized prefill.
CONFIG = """\
model_provider = "deltafind"
model = "{model}"
model_instructions_file = "{instructions}"
check_for_update_on_startup = false
approval_policy = "never"
sandbox_mode = "read-only"
web_search = "disabled"
[features]
multi_agent = false
goals = false
[analytics]
enabled = false
[feedback]
enabled = false
[history]
persistence = "none"
[model_providers.deltafind]
name = "deltafind"
base_url = "{base_url}"
wire_api = "responses"
env_key = "DELTAFIND_API_KEY"
request_max_retries = {retries}
stream_max_retries = 0
stream_idle_timeout_ms = 900000
"""


INSTRUCTIONS = "You are a coding agent running in the Codex CLI. Answer briefly.\n"


def codex_bin() -> Path | None:
    """The pinned CLI, installed on first use; None where node or npm is missing."""
    return npm_cli("@openai/codex", CODEX_VERSION, "codex")


@dataclass
class CodexRun:
    returncode: int
    stdout: str
    stderr: str
    answer: str  # the last agent message (--output-last-message)
    records: list[dict]  # the requests it sent, as the proxy saw them


def run_codex(
    exe: Path,
    daemon_port: int,
    model: str,
    prompt: str,
    timeout: float = 600,
    retries: int = 0,
    files: dict[str, str] | None = None,
    script: Callable[[Path], Callable[[dict], Reply | None]] | None = None,
) -> CodexRun:
    """One `codex exec PROMPT`; `retries` is its request_max_retries, `files` go into its working folder and
    `script(folder)` answers what the proxy should (agent_proxy.LoggingProxy)."""
    home = Path(tempfile.mkdtemp(prefix="codex-home-"))
    work = home / "work"
    work.mkdir()
    for name, text in (files or {}).items():
        (work / name).write_text(text)
    proxy = LoggingProxy(daemon_port, script(work) if script else None).start()
    # Codex's own instructions are ~4k tokens; a short file keeps the prompt inside the demo's 8k context.
    (home / "instructions.md").write_text(INSTRUCTIONS)
    (home / "config.toml").write_text(
        CONFIG.format(
            model=model,
            base_url=f"http://127.0.0.1:{proxy.port}/v1",
            instructions=home / "instructions.md",
            retries=retries,
        )
    )
    last = home / "last.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "CODEX_"))}
    env.update(CODEX_HOME=str(home), DELTAFIND_API_KEY="unused", NO_COLOR="1", RUST_LOG="error")
    try:
        proc = subprocess.run(
            [
                str(exe),
                "exec",
                "--skip-git-repo-check",
                "--ephemeral",
                "--color",
                "never",
                "-C",
                str(work),
                "-o",
                str(last),
                prompt,
            ],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            stdin=subprocess.DEVNULL,
        )
        answer = last.read_text() if last.exists() else ""
        return CodexRun(proc.returncode, proc.stdout, proc.stderr, answer, list(proxy.records))
    finally:
        proxy.stop()
        shutil.rmtree(home, ignore_errors=True)


def main() -> None:
    from tests.e2e.daemon_fixtures import Daemon

    store, name = Path(sys.argv[1]), sys.argv[2]
    exe = codex_bin()
    assert exe is not None, "node/npm missing"
    d = Daemon(store, "[server]\nmax_running = 1\n").start(timeout=600)
    try:
        run = run_codex(exe, d.port, "test-model", "Say hello in one short sentence.")
    finally:
        d.stop()
    print("rc", run.returncode, "answer", repr(run.answer[:200]))
    print(run.stderr[-3000:])
    FIXTURES.mkdir(parents=True, exist_ok=True)
    out = FIXTURES / f"codex-{name}.json"
    out.write_text(
        json.dumps(
            {"cli": f"@openai/codex@{CODEX_VERSION}", "requests": run.records},
            indent=1,
            ensure_ascii=False,
        )
        + "\n"
    )
    print("wrote", out, [(r["method"], r["path"], r.get("status")) for r in run.records])
    print(d.log_text()[-3000:])


if __name__ == "__main__":
    main()
