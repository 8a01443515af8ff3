"""Run the real Claude Code CLI (npm @anthropic-ai/claude-code, pinned) against a live daemon, through a logging proxy.

`claude_bin()` installs the pinned CLI into a cached npm folder (None without node/npm);
`run_claude` points it at the proxy with its documented env vars (telemetry, update checks
and other non-essential traffic off) and runs one `claude -p`. `python -m tests.e2e.claude_cli
STORE NAME [CLI ARGS]` records a session's requests as tests/data/agents/claude-NAME.json.
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

CLAUDE_VERSION = "2.1.197"
# code.claude.com/docs/en/settings (environment variables): no telemetry, error reports, update checks
# or other traffic that is not the model's; the model names every request uses, big and small.
SHORT = 96  # CLAUDE_CODE_MAX_OUTPUT_TOKENS in tests: a small model may otherwise write until the context is full
# Its stream watchdog counts content, not pings: a prefill longer than 300 s (its default) would be abandoned and resent.
PATIENT = {"CLAUDE_STREAM_IDLE_TIMEOUT_MS": "1800000", "API_TIMEOUT_MS": "1800000"}
QUIET = {
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_TELEMETRY": "1",
    "DISABLE_ERROR_REPORTING": "1",
    "DISABLE_AUTOUPDATER": "1",
    "DISABLE_BUG_COMMAND": "1",
    "NO_COLOR": "1",
}


def claude_bin() -> Path | None:
    """The pinned CLI, installed on first use; None where node or npm is missing."""
    return npm_cli("@anthropic-ai/claude-code", CLAUDE_VERSION, "claude")


@dataclass
class ClaudeRun:
    returncode: int
    stdout: str  # the answer (`claude -p` prints it)
    stderr: str
    records: list[dict]  # the requests it sent, as the proxy saw them
    answers: dict[int, bytes]  # the daemon's answer to records[i], where forwarded


def run_claude(
    exe: Path,
    daemon_port: int,
    model: str,
    prompt: str,
    *args: str,
    timeout: float = 600,
    key_env: str = "ANTHROPIC_API_KEY",
    max_output_tokens: int | None = None,
    files: dict[str, str] | None = None,
    script: Callable[[Path], Callable[[dict], Reply | None]] | None = None,
) -> ClaudeRun:
    """One `claude -p PROMPT ARGS...` with a fresh config folder; `key_env` picks x-api-key or Authorization: Bearer,
    `max_output_tokens` the max_tokens it asks for (else its own 32000, cut here to what the context leaves);
    `files` go into its working folder, and `script(folder)` answers what the proxy should (agent_proxy.LoggingProxy)."""
    home = Path(tempfile.mkdtemp(prefix="claude-home-"))
    work = home / "work"
    work.mkdir()
    for name, text in (files or {}).items():
        (work / name).write_text(text)
    proxy = LoggingProxy(daemon_port, script(work) if script else None).start()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE_"))}
    env.update(
        QUIET,
        **PATIENT,
        HOME=str(home),
        CLAUDE_CONFIG_DIR=str(home / "config"),
        ANTHROPIC_BASE_URL=f"http://127.0.0.1:{proxy.port}",
        ANTHROPIC_MODEL=model,
        ANTHROPIC_SMALL_FAST_MODEL=model,
        ANTHROPIC_DEFAULT_HAIKU_MODEL=model,
        ANTHROPIC_DEFAULT_SONNET_MODEL=model,
        ANTHROPIC_DEFAULT_OPUS_MODEL=model,
        **{key_env: "unused"},
    )
    if max_output_tokens is not None:
        env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(max_output_tokens)
    try:
        proc = subprocess.run(
            [str(exe), "-p", prompt, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=work,
            stdin=subprocess.DEVNULL,
        )
        return ClaudeRun(
            proc.returncode, proc.stdout, proc.stderr, list(proxy.records), dict(proxy.answers)
        )
    finally:
        proxy.stop()
        shutil.rmtree(home, ignore_errors=True)


def redact(record: dict) -> dict:
    """A record without what identifies this machine (metadata.user_id's device id)."""
    body = record.get("body")
    if (
        isinstance(body, dict)
        and isinstance(body.get("metadata"), dict)
        and "user_id" in body["metadata"]
    ):
        body = {**body, "metadata": {**body["metadata"], "user_id": '{"device_id":"<redacted>"}'}}
    return {**record, "body": body}


def main() -> None:
    from tests.e2e.daemon_fixtures import Daemon

    store, name, args = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    exe = claude_bin()
    assert exe is not None, "node/npm missing"
    d = Daemon(store, "[server]\nmax_running = 1\nmax_prefill_tokens = 4096\n").start(timeout=600)
    try:
        run = run_claude(exe, d.port, "test-model", "say hi", *args, max_output_tokens=SHORT)
    finally:
        d.stop()
    print("rc", run.returncode, "answer", repr(run.stdout[:200]))
    print(run.stderr[-3000:])
    FIXTURES.mkdir(parents=True, exist_ok=True)
    out = FIXTURES / f"claude-{name}.json"
    out.write_text(
        json.dumps(
            {
                "cli": f"@anthropic-ai/claude-code@{CLAUDE_VERSION}",
                "args": ["-p", "say hi", *args],
                "requests": [redact(r) for r in run.records],
            },
            indent=1,
            ensure_ascii=False,
        )
        + "\n"
    )
    print("wrote", out, [(r["method"], r["path"], r.get("status")) for r in run.records])
    print(d.log_text()[-3000:])


if __name__ == "__main__":
    main()
