"""Fuzzed request bodies against the live daemon: never a 5xx, always OpenAI-shaped, still healthy."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e.daemon_fixtures import Daemon, tiny_store_fixture  # noqa: F401 - the fixture

# A short context and tiny defaults: whatever is accepted finishes in a few fast steps.
CONFIG = """
[server]
max_context = 48
max_tokens_default = 2
max_body_bytes = "64KiB"
max_running = 4
max_queue = 64
"""

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=12), kids, max_size=4),
    max_leaves=12,
)
KEYS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream",
        "stream_options", "stop", "seed", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "user",
        "metadata", "tools", "logit_bias", "echo", "response_format", "best_of", "suffix"]
good_values = {
    "model": st.just("test-model"),
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool"]),
                                                "content": st.text(max_size=30) | json_values}), min_size=0, max_size=3),
    "prompt": st.text(max_size=40) | st.lists(st.integers(-5, 400), max_size=8) | json_values,
    "max_tokens": st.integers(-2, 60) | json_values, "n": st.integers(0, 10), "stream": st.booleans(),
    "temperature": st.floats(-1, 3, allow_nan=False), "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=5),
    "logprobs": st.booleans() | st.integers(-1, 6), "top_logprobs": st.integers(-1, 21),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values,
}


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    path = draw(st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
    kind = draw(st.sampled_from(["bytes", "json", "mutated", "mutated", "mutated"]))
    if kind == "bytes":
        return path, draw(st.binary(max_size=200))
    if kind == "json":
        return path, json.dumps(draw(json_values)).encode()
    body = {"model": "test-model"}
    body["messages" if path.endswith("chat/completions") else "prompt"] = (
        [{"role": "user", "content": "hi"}] if path.endswith("chat/completions") else "hi")
    for key in draw(st.lists(st.sampled_from(KEYS), max_size=5)):
        body[key] = draw(good_values.get(key, json_values))
    if draw(st.booleans()):
        body[draw(st.text(min_size=1, max_size=10))] = draw(json_values)
    raw = json.dumps(body).encode()
    if draw(st.integers(0, 9)) == 0:  # a stray byte somewhere: bad UTF-8 or bad JSON
        i = draw(st.integers(0, len(raw)))
        raw = raw[:i] + draw(st.sampled_from([b"\xff", b"\xc3", b"{", b"\x00"])) + raw[i:]
    return path, raw


@pytest.fixture(scope="module")
def daemon(tiny_store: Path) -> Iterator[Daemon]:
    d = Daemon(tiny_store, CONFIG).start()
    yield d
    assert d.stop() == 0
    d.cleanup()


@pytest.fixture(scope="module")
def conn(daemon: Daemon) -> Iterator[list[http.client.HTTPConnection]]:
    box = [http.client.HTTPConnection("127.0.0.1", daemon.port, timeout=30)]
    yield box
    box[0].close()


def _post(box: list[http.client.HTTPConnection], path: str, raw: bytes) -> tuple[int, bytes]:
    for attempt in range(2):  # a kept-alive connection the server closed: reconnect once
        try:
            box[0].request("POST", path, body=raw, headers={"Content-Type": "application/json"})
            r = box[0].getresponse()
            return r.status, r.read()
        except (http.client.HTTPException, OSError):
            box[0].close()
            box[0] = http.client.HTTPConnection(box[0].host, box[0].port, timeout=30)
            if attempt:
                raise
    raise AssertionError("unreachable")


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=bodies())
def test_fuzzed_bodies_never_get_a_5xx(conn: list[http.client.HTTPConnection], case: tuple[str, bytes]) -> None:
    path, raw = case
    status, body = _post(conn, path, raw)
    assert status < 500, (status, raw, body)
    if status >= 400:
        err = json.loads(body)["error"]
        assert err["message"] and err["type"], body
    elif body.startswith(b"data: "):  # a stream ends with [DONE]
        assert body.rstrip().endswith(b"data: [DONE]"), body
    else:
        assert "choices" in json.loads(body)


def test_the_daemon_is_still_healthy_after_the_fuzz(daemon: Daemon) -> None:
    assert daemon.get("/health")[0] == 200
    metrics = daemon.get("/metrics")[1].decode()
    counts = {line.split("}")[0] + "}": int(float(line.split()[-1])) for line in metrics.splitlines()
              if line.startswith("deltafind_http_requests_total{")}
    print(counts)
    # the fuzz reached generation as well as validation
    assert sum(n for k, n in counts.items() if 'status="200"' in k) >= 20
    assert sum(n for k, n in counts.items() if 'status="400"' in k) >= 500
    assert "engine_step_failed" not in daemon.log_text(full=True) and "request_failed" not in daemon.log_text(full=True)
