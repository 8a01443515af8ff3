"""A loopback logging proxy (stdlib http.server) between a real agent CLI and the daemon.

It forwards every request unchanged, streams the answer back as it arrives, and
records each request (method, path, headers without secrets, JSON body) and the
answer's status, so a CLI session can be kept as fixtures under tests/data/agents/.
"""

from __future__ import annotations

import http.client
import json
import shutil
import subprocess
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

# What a scripted proxy answers itself instead of forwarding: (status, headers, body).
Reply = tuple[int, dict[str, str], bytes]

SECRET_HEADERS = {"authorization", "x-api-key", "cookie", "proxy-authorization"}
HOP_HEADERS = {
    "connection",
    "keep-alive",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "host",
    "content-length",
}


NPM_DIR = (
    Path.home() / ".cache" / "deltafind-tests" / "npm"
)  # the pinned agent CLIs, installed once and reused
FIXTURES = Path(__file__).resolve().parents[1] / "data" / "agents"  # their recorded requests


def npm_cli(package: str, version: str, bin_name: str) -> Path | None:
    """The pinned npm CLI `package@version` (its `bin_name`), installed into NPM_DIR on first use;
    None where node or npm is missing or the install fails."""
    exe = NPM_DIR / "node_modules" / ".bin" / bin_name
    pkg = NPM_DIR / "node_modules" / Path(*package.split("/")) / "package.json"
    if exe.exists() and pkg.exists() and json.loads(pkg.read_text()).get("version") == version:
        return exe
    if shutil.which("node") is None or shutil.which("npm") is None:
        return None
    proc = subprocess.run(
        [
            "npm",
            "install",
            "--no-audit",
            "--no-fund",
            "--prefix",
            str(NPM_DIR),
            f"{package}@{version}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    return exe if proc.returncode == 0 and exe.exists() else None


class LoggingProxy:
    """`LoggingProxy(upstream_port).start()`; `records` holds one dict per request, in order.

    `script(record)` may answer a request itself (a `Reply`) instead of forwarding it: a recorded session's
    tool calls and errors, which a model with random weights would never write (tests/e2e/agent_session.py)."""

    def __init__(
        self, upstream_port: int, script: Callable[[dict[str, Any]], Reply | None] | None = None
    ) -> None:
        self.upstream_port = upstream_port
        self.script = script
        self.records: list[dict[str, Any]] = []
        self.answers: dict[
            int, bytes
        ] = {}  # record index -> the answer's body as forwarded (not recorded in fixtures)
        self.lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body: Any = json.loads(raw) if raw else None
                except ValueError:
                    body = raw.decode("utf-8", "replace")
                headers = {
                    k.lower(): v
                    for k, v in self.headers.items()
                    if k.lower() not in SECRET_HEADERS | HOP_HEADERS
                }
                rec = {"method": self.command, "path": self.path, "headers": headers, "body": body}
                with proxy.lock:
                    index = len(proxy.records)
                    proxy.records.append(rec)
                    reply = proxy.script(rec) if proxy.script is not None else None
                if reply is not None:
                    status, reply_headers, payload = reply
                    rec["status"] = status
                    self.send_response(status)
                    for k, v in {**reply_headers, "Content-Length": str(len(payload))}.items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                up = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=900)
                fwd = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
                up.request(self.command, self.path, body=raw or None, headers=fwd)
                r = up.getresponse()
                rec["status"] = r.status
                self.send_response(r.status)
                for k, v in r.getheaders():
                    if k.lower() not in HOP_HEADERS:
                        self.send_header(k, v)
                if self.command == "HEAD":
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    up.close()
                    return
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                got = []
                while True:
                    piece = r.read1(65536)
                    if not piece:
                        break
                    got.append(piece)
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                up.close()
                proxy.answers[index] = b"".join(got)

            do_GET = do_POST = do_HEAD = do_DELETE = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]

    def start(self) -> LoggingProxy:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
