"""A loopback Hugging Face-compatible hub for tests: serves model folders the way the hub does.

Routes huggingface_hub calls: `GET /api/models/{repo}[/revision/{rev}]` (repo info
with file sizes, git blob ids and LFS sha256), and `HEAD|GET /{repo}/resolve/{rev}/{file}`
with Range requests and the hub's headers (ETag, X-Repo-Commit, X-Linked-Etag,
X-Linked-Size). Faults for tests: drop a connection partway through a body,
flip a byte in a response, throttle, or fail a file with 500s. Every request
is logged with its Range header and the body bytes actually sent.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "c5d1dd4c428bd1ce8b88c5044f3b6ccde9e3b721"
TOKEN = "hf_test_token"
RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")
INFO = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/?]+))?$")


@dataclass
class Faults:
    drop_after: dict[str, int] = field(
        default_factory=dict
    )  # file -> body bytes sent before the connection drops (once)
    corrupt_at: dict[str, int] = field(
        default_factory=dict
    )  # file -> absolute offset flipped in the first response covering it
    fail: set[str] = field(default_factory=set)  # files answered with `fail_status`, always
    fail_status: int = 500
    rate_bytes_s: float | None = None  # throttle every body


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    sent: int = 0  # body bytes written


class FakeHub:
    """`with FakeHub({"org/name": folder}) as hub:` then point HF_ENDPOINT at `hub.endpoint`."""

    def __init__(self, repos: dict[str, Path], token: str | None = TOKEN) -> None:
        self.repos = {name: Path(p) for name, p in repos.items()}
        self.token = token
        self.faults = Faults()
        self.log: list[Request] = []
        self._lock = threading.Lock()
        self.meta: dict[str, dict[str, dict]] = {}
        for name, folder in self.repos.items():
            files = {}
            for f in sorted(folder.rglob("*")):
                if f.is_file():
                    data = f.read_bytes()
                    files[f.relative_to(folder).as_posix()] = {
                        "size": len(data),
                        "sha256": hashlib.sha256(data).hexdigest(),
                        "blob": hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest(),
                        "lfs": f.suffix
                        in (".safetensors", ".gguf"),  # the hub keeps weights in LFS
                    }
            self.meta[name] = files
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> FakeHub:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def requests(self, file: str, method: str = "GET") -> list[Request]:
        with self._lock:
            return [r for r in self.log if r.method == method and r.path.endswith("/" + file)]

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                self._serve(body=False)

            def do_GET(self) -> None:
                self._serve(body=True)

            def _reply(self, code: int, headers: dict[str, str], body: bytes = b"") -> None:
                self.send_response(code)
                for k, v in {**headers, "Content-Length": str(len(body))}.items():
                    self.send_header(k, v)
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _serve(self, body: bool) -> None:
                req = Request(self.command, self.path, self.headers.get("Range"))
                with hub._lock:
                    hub.log.append(req)
                if hub.token and self.headers.get("Authorization") != f"Bearer {hub.token}":
                    return self._reply(
                        401,
                        {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Invalid credentials"},
                    )
                path = self.path.split("?", 1)[0]
                if m := INFO.match(path):
                    return self._info(m["repo"], m["rev"])
                if m := RESOLVE.match(path):
                    return self._file(m["repo"], m["rev"], m["file"], req, body)
                self._reply(404, {"X-Error-Code": "EntryNotFound"})

            def _known(self, repo: str, rev: str | None) -> bool:
                if repo not in hub.meta:
                    self._reply(
                        404,
                        {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"},
                    )
                    return False
                if rev not in (None, "main", COMMIT):
                    self._reply(
                        404,
                        {"X-Error-Code": "RevisionNotFound", "X-Error-Message": "Invalid rev id"},
                    )
                    return False
                return True

            def _info(self, repo: str, rev: str | None) -> None:
                if not self._known(repo, rev):
                    return
                siblings = [
                    {
                        "rfilename": n,
                        "size": m["size"],
                        "blobId": m["blob"],
                        **(
                            {"lfs": {"sha256": m["sha256"], "size": m["size"], "pointerSize": 134}}
                            if m["lfs"]
                            else {}
                        ),
                    }
                    for n, m in hub.meta[repo].items()
                ]
                data = json.dumps(
                    {
                        "id": repo,
                        "modelId": repo,
                        "sha": COMMIT,
                        "private": False,
                        "siblings": siblings,
                    }
                ).encode()
                self._reply(200, {"Content-Type": "application/json"}, data)

            def _file(self, repo: str, rev: str, name: str, req: Request, body: bool) -> None:
                if not self._known(repo, rev):
                    return
                meta = hub.meta[repo].get(name)
                if meta is None:
                    return self._reply(
                        404, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": COMMIT}
                    )
                if name in hub.faults.fail:
                    return self._reply(hub.faults.fail_status, {"X-Repo-Commit": COMMIT})
                size = meta["size"]
                etag = f'"{meta["sha256"] if meta["lfs"] else meta["blob"]}"'
                headers = {
                    "X-Repo-Commit": COMMIT,
                    "ETag": etag,
                    "Accept-Ranges": "bytes",
                    "Content-Type": "application/octet-stream",
                }
                if meta["lfs"]:
                    headers |= {"X-Linked-Etag": etag, "X-Linked-Size": str(size)}
                start, end, code = 0, size, 200
                if req.range and (m := re.match(r"bytes=(\d+)-(\d*)$", req.range)):
                    start, end, code = int(m[1]), (int(m[2]) + 1 if m[2] else size), 206
                    if start >= size:
                        return self._reply(416, {**headers, "Content-Range": f"bytes */{size}"})
                    end = min(end, size)
                    headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
                if not body:
                    self.send_response(code)
                    for k, v in {**headers, "Content-Length": str(end - start)}.items():
                        self.send_header(k, v)
                    return self.end_headers()
                data = bytearray((hub.repos[repo] / name).read_bytes()[start:end])
                with hub._lock:
                    flip = hub.faults.corrupt_at.get(name)
                    if flip is not None and start <= flip < end:
                        data[flip - start] ^= 0x40
                        del hub.faults.corrupt_at[name]
                    drop = hub.faults.drop_after.get(name)
                    if drop is not None and drop < len(data):
                        del hub.faults.drop_after[name]
                    else:
                        drop = None
                self.send_response(code)
                for k, v in {**headers, "Content-Length": str(len(data))}.items():
                    self.send_header(k, v)
                self.end_headers()
                limit = len(data) if drop is None else min(drop, len(data))
                step = 16384
                try:
                    for i in range(0, limit, step):
                        chunk = data[i : min(i + step, limit)]
                        if hub.faults.rate_bytes_s:
                            time.sleep(len(chunk) / hub.faults.rate_bytes_s)
                        self.wfile.write(chunk)
                        self.wfile.flush()
                        req.sent += len(chunk)
                # the client went away (a killed setup)
                except (
                    BrokenPipeError,
                    ConnectionResetError,
                ):
                    self.close_connection = True
                    return
                if drop is not None:
                    self.close_connection = True
                    self.connection.shutdown(2)  # the body ends short: a dropped connection

        return Handler
