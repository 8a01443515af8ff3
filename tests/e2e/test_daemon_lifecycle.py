"""The daemon's life: sd_notify order, SIGTERM mid-stream, SIGHUP, keys, limits, startup failures."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.e2e.daemon_fixtures import BIN, Daemon, tiny_store_fixture  # noqa: F401 - the fixture

KEYED = """
[server]
api_keys = ["sekrit-1", "sekrit-2"]
max_body_bytes = "4KiB"
max_tokens_default = 4
"""


@pytest.fixture(scope="module")
def keyed(tiny_store: Path) -> Iterator[Daemon]:
    d = Daemon(tiny_store, KEYED).start()
    yield d
    assert d.stop() == 0
    d.cleanup()


def test_api_keys_are_required_and_health_stays_open(keyed: Daemon) -> None:
    base = keyed.url + "/v1"
    with (
        openai.OpenAI(base_url=base, api_key="wrong", max_retries=0) as bad,
        pytest.raises(openai.AuthenticationError) as e,
    ):
        bad.models.list()
    assert e.value.body["code"] == "invalid_api_key"
    with openai.OpenAI(base_url=base, api_key="sekrit-2", max_retries=0) as ok:
        r = ok.chat.completions.create(
            model="test-model", messages=[{"role": "user", "content": "hi"}]
        )
    assert r.usage.completion_tokens <= 4
    assert keyed.get("/health")[0] == 200
    assert keyed.get("/metrics")[0] == 401


def test_the_anthropic_x_api_key_header_is_a_key_too(keyed: Daemon) -> None:
    """Claude Code sends `x-api-key` when ANTHROPIC_API_KEY is set: the official SDK with a right key is
    served, a wrong one gets 401 in Anthropic's error shape."""
    import anthropic

    with anthropic.Anthropic(base_url=keyed.url, api_key="sekrit-1", max_retries=0) as ok:
        r = ok.messages.create(
            model="test-model", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
    assert r.usage.output_tokens <= 2
    with (
        anthropic.Anthropic(base_url=keyed.url, api_key="wrong", max_retries=0) as bad,
        pytest.raises(anthropic.AuthenticationError) as e,
    ):
        bad.messages.create(
            model="test-model", max_tokens=2, messages=[{"role": "user", "content": "hi"}]
        )
    assert (
        e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
    )


def test_body_limit_and_unknown_routes_are_openai_shaped(keyed: Daemon) -> None:
    auth = {"Authorization": "Bearer sekrit-1", "Content-Type": "application/json"}
    body = json.dumps({"model": "test-model", "prompt": "x" * 5000}).encode()
    status, raw = keyed.request("POST", "/v1/completions", body, auth)
    assert status == 413 and json.loads(raw)["error"]["code"] == "body_too_large"
    status, raw = keyed.request("GET", "/v1/nothing", None, auth)
    assert status == 404 and "error" in json.loads(raw)


def test_sighup_reloads_in_the_worker(keyed: Daemon) -> None:
    assert keyed.proc is not None
    keyed.config.write_text(
        keyed.config.read_text().replace("max_tokens_default = 4", "max_tokens_default = 2")
    )
    keyed.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 15
    while '"reloaded"' not in keyed.log_text(full=True) and time.monotonic() < deadline:
        time.sleep(0.2)
    with openai.OpenAI(base_url=keyed.url + "/v1", api_key="sekrit-1", max_retries=0) as ok:
        assert (
            ok.completions.create(
                model="test-model", prompt="ab", temperature=0
            ).usage.completion_tokens
            <= 2
        )
    assert (
        keyed.log_text(full=True).count("Booting worker") == 1
    )  # the same worker: no second model in memory


def test_startup_failures_exit_with_distinct_codes(tmp_path: Path) -> None:
    proc = subprocess.run(
        [str(BIN / "deltafind"), "serve", "--store", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (
        proc.returncode == 3
        and "not a deltafind store" in proc.stderr
        and "Traceback" not in proc.stderr
    )
    bad = tmp_path / "bad.toml"
    bad.write_text("[server]\nport = -1\n")
    proc = subprocess.run(
        [str(BIN / "deltafind"), "--config", str(bad)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "server.port" in proc.stderr


def _notify_listener(path: Path) -> tuple[socket.socket, list[tuple[float, str]]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(0.2)
    got: list[tuple[float, str]] = []

    def run() -> None:
        while sock.fileno() >= 0:
            try:
                got.append((time.monotonic(), sock.recv(4096).decode()))
            except TimeoutError:
                continue
            except OSError:
                return

    threading.Thread(target=run, daemon=True).start()
    return sock, got


def test_ready_after_warmup_watchdog_and_sigterm_mid_stream_exits_0(demo_store: Path) -> None:
    d = Daemon(demo_store, "[server]\ngraceful_timeout_s = 3\n")
    sock, got = _notify_listener(d.dir / "notify.sock")
    d.env.update(NOTIFY_SOCKET=str(d.dir / "notify.sock"), WATCHDOG_USEC="400000")
    try:
        d.start()
        healthy_at = time.monotonic()
        messages = [m for _, m in got]
        assert not any("Gunicorn" in m for m in messages), (
            messages
        )  # gunicorn's early READY never reached us
        ready = [t for t, m in got if "READY=1" in m]
        assert (
            ready and ready[0] <= healthy_at and any("STATUS=loading model" in m for m in messages)
        )
        assert any("STATUS=warming up" in m for m in messages)
        client = openai.OpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0, timeout=60)
        stream = client.completions.create(
            model="test-model",
            prompt="Once upon a time",
            max_tokens=1000,
            temperature=0,
            stream=True,
        )
        chunks = []
        for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 2:
                assert d.proc is not None
                d.proc.send_signal(signal.SIGTERM)
        # cut by the drain grace: "cancelled", never "length" (which reads as max_tokens reached)
        assert chunks[-1].choices[0].finish_reason == "cancelled" and 2 < len(chunks) < 1000
        assert d.proc.wait(30) == 0
        messages = [m for _, m in got]
        assert any("WATCHDOG=1" in m for m in messages) and any("STOPPING=1" in m for m in messages)
    finally:
        sock.close()
        d.cleanup()
