"""A real `deltafind serve` subprocess on a free port and a temp control socket."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    """Start with `Daemon(store, config_toml).start()`; `stop()` sends SIGTERM and returns the exit code."""

    def __init__(self, store: Path, config: str = "", env: dict[str, str] | None = None) -> None:
        # A short folder: sun_path holds 107 bytes and pytest's tmp paths can be long.
        self.dir = Path(tempfile.mkdtemp(prefix="dfd-"))
        self.port = free_port()
        self.socket = self.dir / "ctl.sock"
        self.config = self.dir / "deltafind.toml"
        self.config.write_text(f'[model]\nstore = "{store}"\nname = "test-model"\n' + config)
        self.log = self.dir / "daemon.log"
        self.env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120) -> Daemon:
        cmd = [
            str(BIN / "deltafind"),
            "serve",
            "--config",
            str(self.config),
            "--server-port",
            str(self.port),
            "--socket",
            str(self.socket),
        ]
        self.proc = subprocess.Popen(
            cmd, stdout=self.log.open("w"), stderr=subprocess.STDOUT, env=self.env
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited {self.proc.returncode}:\n{self.log_text()}")
            try:
                if self.get("/health")[0] == 200:
                    return self
            except OSError:
                pass
            time.sleep(0.2)
        self.kill()
        raise AssertionError(f"daemon not healthy in {timeout} s:\n{self.log_text()}")

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        return self.request("GET", path, None, headers)

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 60,
    ) -> tuple[int, bytes]:
        req = urllib.request.Request(
            self.url + path, data=body, method=method, headers=headers or {}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def post_json(self, path: str, obj: object, **kw) -> tuple[int, dict]:
        status, raw = self.request(
            "POST", path, json.dumps(obj).encode(), {"Content-Type": "application/json"}, **kw
        )
        return status, json.loads(raw)

    def ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(BIN / "deltafinctl"), "--socket", str(self.socket), *args],
            capture_output=True,
            text=True,
            timeout=60,
            env=self.env,
        )

    def log_text(self, full: bool = False) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return text if full else text[-6000:]

    def stop(self, timeout: float = 60) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def cleanup(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session", name="tiny_store")
def tiny_store_fixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A seeded random llama store with a byte-level tokenizer: fast steps for plumbing tests."""
    from tests.conftest import deltafind_cmd

    store = tmp_path_factory.mktemp("tiny") / "store"
    proc = deltafind_cmd(
        "setup", "--synthetic", "llama", "--shape", "tiny", "--store", str(store), "--quiet"
    )
    assert proc.returncode == 0, proc.stderr
    return store
