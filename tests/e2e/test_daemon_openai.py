"""The real daemon on the demo store, driven by the official openai client (and deltafinctl)."""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.e2e.daemon_fixtures import Daemon

PROMPT = "The capital of France is"
CONFIG = """
[server]
max_running = 8
max_queue = 16
max_tokens_default = 16
graceful_timeout_s = 5
[cache]
expert_bytes = "1GiB"
"""


@pytest.fixture(scope="module")
def daemon(demo_store: Path) -> Iterator[Daemon]:
    d = Daemon(demo_store, CONFIG).start()
    yield d
    rc = d.stop()
    d.cleanup()
    assert rc == 0


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()  # no kept-alive connection for the shutdown to wait out


def test_models_health_and_request_ids(daemon: Daemon, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["test-model"]
    status, body = daemon.get("/health")
    assert status == 200 and json.loads(body)["status"] == "ready"
    raw = client.models.with_raw_response.list(extra_headers={"X-Request-Id": "abc-123"})
    assert raw.headers["x-request-id"] == "abc-123"


def test_completion_greedy_streamed_equals_unstreamed_with_usage(client: openai.OpenAI) -> None:
    full = client.completions.create(model="test-model", prompt=PROMPT, max_tokens=6, temperature=0)
    assert full.choices[0].text.startswith(" Paris") and full.choices[0].finish_reason == "length"
    assert (
        full.usage.completion_tokens == 6
        and full.usage.total_tokens == full.usage.prompt_tokens + 6
    )
    chunks = list(
        client.completions.create(
            model="test-model",
            prompt=PROMPT,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_streamed_and_not(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(
        model="test-model", messages=msgs, max_tokens=12, temperature=0
    )
    text = r.choices[0].message.content
    assert "Paris" in text and r.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model="test-model", messages=msgs, max_tokens=12, temperature=0, stream=True
    )
    deltas = list(stream)
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(d.choices[0].delta.content or "" for d in deltas) == text
    assert deltas[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_stop_strings_end_the_text_before_the_stop(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model="test-model", prompt=PROMPT, max_tokens=12, temperature=0, stop=[".", "\n"]
    )
    assert r.choices[0].text == " Paris" and r.choices[0].finish_reason == "stop"
    chunks = list(
        client.completions.create(
            model="test-model", prompt=PROMPT, max_tokens=12, temperature=0, stop="is:", stream=True
        )
    )
    text = "".join(c.choices[0].text for c in chunks)
    assert "is:" not in text and chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_seed_reproduces_and_n_gives_distinct_choices(client: openai.OpenAI) -> None:
    kw = dict(
        model="test-model", prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=1234
    )
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text
    many = client.completions.create(**{**kw, "n": 3})
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert many.choices[0].text == a.choices[0].text  # choice i samples with seed + i
    assert many.usage.completion_tokens <= 24 and many.usage.prompt_tokens == a.usage.prompt_tokens


def test_top_k_is_honoured_on_chat_and_completions(client: openai.OpenAI) -> None:
    # top_k as llama.cpp's and vLLM's servers take it: top_k=1 samples the most likely token, greedy at any temperature.
    kw = dict(model="test-model", max_tokens=8, seed=7)
    greedy = client.completions.create(prompt="Once upon a time", temperature=0, **kw)
    k1 = client.completions.create(
        prompt="Once upon a time", temperature=1.5, extra_body={"top_k": 1}, **kw
    )
    assert k1.choices[0].text == greedy.choices[0].text
    msgs = [{"role": "user", "content": "Tell me a story."}]
    greedy_chat = client.chat.completions.create(messages=msgs, temperature=0, **kw)
    k1_chat = client.chat.completions.create(
        messages=msgs, temperature=1.5, extra_body={"top_k": 1}, **kw
    )
    assert k1_chat.choices[0].message.content == greedy_chat.choices[0].message.content


def test_logprobs_chat_and_completions(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="test-model",
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(
        len(t.top_logprobs) == 2
        and t.logprob <= 0
        and t.top_logprobs[0].logprob >= t.logprob - 1e-6
        for t in content
    )
    c = client.completions.create(
        model="test-model", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2
    )
    lp = c.choices[0].logprobs
    assert lp.tokens[0] == " Paris" and len(lp.token_logprobs) == 3 and len(lp.top_logprobs[0]) == 2


def test_unsupported_and_invalid_requests_are_400_naming_the_field(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "Hi"}]
    cases = [
        (dict(tools=[{"type": "web_search"}]), "tools[0]"),  # function tools only
        (dict(extra_body={"frobnicate": 1}), "frobnicate"),
        (dict(temperature=5), "temperature"),
        (dict(stop=["a", "b", "c", "d", "e"]), "stop"),
        (
            dict(
                messages=[
                    {
                        "role": "user",
                        "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                    }
                ]
            ),
            "messages[0].content[0].type",
        ),
        (dict(max_tokens=10**9), "messages"),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                **{"model": "test-model", "messages": msgs, "max_tokens": 2, **extra}
            )
        assert e.value.body["param"] == param, (extra, e.value.body)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=msgs)


def _stream_text(client: openai.OpenAI, prompt: str) -> str:
    chunks = client.completions.create(
        model="test-model", prompt=prompt, max_tokens=8, temperature=0, stream=True
    )
    return "".join(c.choices[0].text for c in chunks)


def test_eight_concurrent_streams_match_one_at_a_time(
    daemon: Daemon, client: openai.OpenAI
) -> None:
    prompts = [
        "The capital of France is",
        "Once upon a time",
        "def fib(n):",
        "My favourite colour is",
        "1, 2, 3, 4,",
        "The quick brown fox",
        "Water boils at",
        "In 1492, Columbus",
    ]
    alone = [_stream_text(client, p) for p in prompts]
    together: list[str | None] = [None] * len(prompts)

    def run(i: int) -> None:
        together[i] = _stream_text(client, prompts[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert together == alone
    metrics = daemon.get("/metrics")[1].decode()
    assert 'deltafind_http_requests_total{endpoint="/v1/completions",status="200"}' in metrics


def _running(daemon: Daemon) -> int:
    proc = daemon.ctl("--json", "status")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["running"]


def test_a_client_closing_mid_stream_frees_its_slot(daemon: Daemon, client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model="test-model", prompt="Once upon a time", max_tokens=2000, temperature=0, stream=True
    )
    it = iter(stream)
    next(it), next(it)
    assert _running(daemon) == 1
    stream.response.close()
    deadline = time.monotonic() + 20
    while _running(daemon) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _running(daemon) == 0
    assert (
        'deltafind_sequences_finished_total{reason="cancelled"}'
        in daemon.get("/metrics")[1].decode()
    )


def test_deltafinctl_status_json_and_summary(daemon: Daemon) -> None:
    proc = daemon.ctl("--json", "status")
    s = json.loads(proc.stdout)
    assert (
        s["model"] == "test-model"
        and s["ready"]
        and not s["draining"]
        and s["config_path"] == str(daemon.config)
    )
    store = s["snapshot"]["store"]
    assert (
        len(store["drives"]) == 2
        and all(d["healthy"] for d in store["drives"])
        and store["cache_requested"] > 0
    )
    # The demo is dense and fits the 1 GiB budget: every layer's MLP held whole, nothing for the
    # prefetch gate to predict (its per-layer rows: tests/unit/test_streaming.py)
    assert (
        store["dense_held_layers"] == 30
        and store["dense_held_bytes"] > 0
        and store["experts_read"] == 30
    )
    assert store["prefetch_gate"]["layers"] == [] and len(store["prefetch_gate"]["drives"]) == 2
    text = daemon.ctl("status").stdout
    assert "test-model (ready)" in text and "drive 1" in text and "dense layers held 30" in text
    mode = stat.S_IMODE(os.stat(daemon.socket).st_mode)
    assert mode == 0o600


def test_deltafinctl_reload_valid_and_invalid(daemon: Daemon, client: openai.OpenAI) -> None:
    original = daemon.config.read_text()
    try:
        daemon.config.write_text(
            original.replace("max_tokens_default = 16", "max_tokens_default = 3")
            + "[device]\nthreads = 1\n"
        )
        proc = daemon.ctl("--json", "reload")
        r = json.loads(proc.stdout)
        assert proc.returncode == 0 and r["ok"] and "server.max_tokens_default" in r["applied"]
        assert r["restart_needed"] == ["device.threads"]
        assert (
            client.completions.create(
                model="test-model", prompt=PROMPT, temperature=0
            ).usage.completion_tokens
            == 3
        )
        daemon.config.write_text(original.replace("max_queue = 16", 'max_queue = "lots"'))
        proc = daemon.ctl("reload")
        assert proc.returncode == 1 and "server.max_queue" in proc.stderr and "lots" in proc.stderr
        assert (
            client.completions.create(
                model="test-model", prompt=PROMPT, temperature=0
            ).usage.completion_tokens
            == 3
        )
    finally:
        daemon.config.write_text(original)
        assert daemon.ctl("reload").returncode == 0
