"""The Falcon app in-process over a scripted engine: readiness, limits, stop strings, SSE shape."""

from __future__ import annotations

import itertools
import json
import threading

import pytest
import structlog
from falcon import testing
from structlog.testing import capture_logs

from deltafind.engine.scheduler import Draining, QueueFull
from deltafind.engine.sequence import FinishEvent, GenRequest, Handle, TokenEvent
from deltafind.server import AppState, ReadyEngine, ServerConfig, create_app
from deltafind.server.app import check_key
from deltafind.server.errors import ApiError
from deltafind.tokenizer import Tokenizer
from tests.conftest import write_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizer(folder)  # one token per byte: multi-byte characters span tokens
    return Tokenizer.load(folder)


class ScriptedEngine:
    """Answers every request with the bytes of `text` as tokens, then `reason`."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        text: str = "",
        reason: str = "length",
        error: Exception | None = None,
    ) -> None:
        self.tok, self.text, self.reason, self.error = tokenizer, text, reason, error
        self.ids = itertools.count()
        self.draining = False
        self.submitted: list[GenRequest] = []
        self.cancelled: list[int] = []

    def submit(self, req: GenRequest, mux=None) -> Handle:
        if self.error is not None:
            raise self.error
        self.submitted.append(req)
        seq = next(self.ids)
        handle = Handle(seq, lambda: self.cancelled.append(seq), mux)
        tokens = self.tok.encode(self.text)[: req.params.max_new_tokens]

        def run() -> None:
            for t in tokens:
                if handle.cancelled:
                    handle.put(FinishEvent("cancelled", len(req.prompt_ids), len(tokens)))
                    return
                handle.put(TokenEvent(t, -0.5, ((t, -0.5),) if req.logprobs else ()))
            handle.put(FinishEvent(self.reason, len(req.prompt_ids), len(tokens)))

        threading.Thread(target=run, daemon=True).start()
        return handle

    def snapshot(self):  # the keys Scheduler.snapshot gives, for an idle engine
        from deltafind.engine.stats import EngineStats

        return {
            "running": 0,
            "waiting": 0,
            "draining": self.draining,
            "tok_s": 0.0,
            "max_running": 8,
            "max_queue": 64,
            "prefix_hits": 0,
            "prefix_misses": 0,
            "prefix_bytes": 0,
            "prefix_reused_tokens": 0,
            "draft_source": "",
            "draft_mode": "off",
            **EngineStats().snapshot(),
        }


def make(
    tokenizer: Tokenizer, engine: ScriptedEngine | None = None, **config
) -> tuple[testing.TestClient, AppState]:
    state = AppState(ServerConfig(**config), "m")
    if engine is not None:
        state.set_ready(ReadyEngine(engine, tokenizer, "m", 64))
    return testing.TestClient(create_app(state)), state


def chat(text: str = "hi", **extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": text}], **extra}


def test_loading_answers_503_model_loading_and_health_503(tokenizer: Tokenizer) -> None:
    c, state = make(tokenizer)
    r = c.simulate_post("/v1/chat/completions", json=chat())
    assert (
        r.status_code == 503
        and r.json["error"]["code"] == "model_loading"
        and r.headers["retry-after"]
    )
    assert c.simulate_get("/health").status_code == 503
    state.set_failed("store gone")
    assert c.simulate_get("/health").json["status"] == "failed"


def test_queue_full_is_429_with_retry_after_and_draining_503(tokenizer: Tokenizer) -> None:
    c, _ = make(tokenizer, ScriptedEngine(tokenizer, error=QueueFull("busy", 2)))
    r = c.simulate_post("/v1/chat/completions", json=chat())
    assert (
        r.status_code == 429
        and r.headers["retry-after"] == "2"
        and r.json["error"]["type"] == "rate_limit_error"
    )
    c, _ = make(tokenizer, ScriptedEngine(tokenizer, error=Draining("draining")))
    assert (
        c.simulate_post("/v1/completions", json={"model": "m", "prompt": "x"}).json["error"]["code"]
        == "server_draining"
    )


def test_api_keys_compare_every_key_and_answer_401(tokenizer: Tokenizer) -> None:
    check_key("Bearer b", None, ("a", "b"))
    check_key(None, "a", ("a", "b"))  # Anthropic's x-api-key
    for header, api_key in (
        (None, None),
        ("Bearer c", None),
        ("Basic b", None),
        ("b", None),
        (None, "c"),
        (None, ""),
    ):
        with pytest.raises(ApiError):
            check_key(header, api_key, ("a", "b"))
    c, _ = make(tokenizer, ScriptedEngine(tokenizer, "ok"), api_keys=("k",))
    assert c.simulate_post("/v1/chat/completions", json=chat()).status_code == 401
    assert (
        c.simulate_post(
            "/v1/chat/completions", json=chat(), headers={"Authorization": "Bearer k"}
        ).status_code
        == 200
    )
    r = c.simulate_post(
        "/v1/messages",
        json={"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]},
    )
    assert (
        r.status_code == 401
        and r.json["type"] == "error"
        and r.json["error"]["type"] == "authentication_error"
    )
    r = c.simulate_post(
        "/v1/messages",
        json={"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]},
        headers={"x-api-key": "k"},
    )
    assert r.status_code == 200 and r.json["type"] == "message"
    assert c.simulate_get("/health").status_code == 200
    assert c.simulate_head("/").status_code == 200  # Claude Code's probe carries no key


def test_body_limit_413(tokenizer: Tokenizer) -> None:
    c, _ = make(tokenizer, ScriptedEngine(tokenizer, "ok"), max_body_bytes=100)
    r = c.simulate_post("/v1/chat/completions", json=chat("x" * 200))
    assert r.status_code == 413 and r.json["error"]["code"] == "body_too_large"


def test_context_limit_and_default_max_tokens(tokenizer: Tokenizer) -> None:
    engine = ScriptedEngine(tokenizer, "abc")
    c, _ = make(tokenizer, engine, max_tokens_default=5, max_context=32)
    r = c.simulate_post("/v1/completions", json={"model": "m", "prompt": "x" * 40})
    assert (
        r.status_code == 400
        and r.json["error"]["code"] == "context_length_exceeded"
        and r.json["error"]["param"] == "prompt"
    )
    assert (
        c.simulate_post(
            "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 40}
        ).status_code
        == 400
    )
    assert c.simulate_post("/v1/completions", json={"model": "m", "prompt": "x"}).status_code == 200
    assert engine.submitted[-1].params.max_new_tokens == 5
    c.simulate_post("/v1/completions", json={"model": "m", "prompt": "x" * 30})
    assert engine.submitted[-1].params.max_new_tokens == 2  # what the context has left


def test_no_limit_means_the_rest_of_the_context_on_every_endpoint(tokenizer: Tokenizer) -> None:
    # Codex sends no max_output_tokens and expects a whole answer (the reference APIs' default), not 512.
    engine = ScriptedEngine(tokenizer, "abc")
    state = AppState(ServerConfig(), "m")
    state.set_ready(ReadyEngine(engine, tokenizer, "m", 4096))
    c = testing.TestClient(create_app(state))
    assert c.simulate_post("/v1/responses", json={"model": "m", "input": "hi"}).status_code == 200
    prompt = len(engine.submitted[-1].prompt_ids)
    assert engine.submitted[-1].params.max_new_tokens == 4096 - prompt
    assert c.simulate_post("/v1/chat/completions", json=chat()).status_code == 200
    assert engine.submitted[-1].params.max_new_tokens == 4096 - len(engine.submitted[-1].prompt_ids)
    state.config = ServerConfig(max_tokens_default=100)  # the optional cap still caps
    assert c.simulate_post("/v1/responses", json={"model": "m", "input": "hi"}).status_code == 200
    assert engine.submitted[-1].params.max_new_tokens == 100


def test_omitted_sampling_takes_the_server_default_then_the_model_default(tmp_path) -> None:
    # Agents (Codex, Claude Code) send no temperature: the operator's default, else the model's
    # generation_config.json, else the reference APIs' 1.0.
    write_tiny_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.9, "top_k": 20.5})  # top_k not an int: ignored
    )
    tok = Tokenizer.load(tmp_path)
    assert tok.sampling_defaults == {"temperature": 0.6, "top_p": 0.9}
    engine = ScriptedEngine(tok, "ok")
    state = AppState(ServerConfig(), "m")
    state.set_ready(ReadyEngine(engine, tok, "m", 4096))
    c = testing.TestClient(create_app(state))
    bodies = {
        "/v1/responses": {"model": "m", "input": "hi"},
        "/v1/chat/completions": chat(),
        "/v1/completions": {"model": "m", "prompt": "x"},
        "/v1/messages": {
            "model": "m",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}],
        },
    }

    def sampled(path: str, **extra) -> tuple[float, float, int]:
        r = c.simulate_post(path, json={**bodies[path], **extra})
        assert r.status_code == 200, r.text
        p = engine.submitted[-1].params
        return p.temperature, p.top_p, p.top_k

    for path in bodies:
        assert sampled(path) == (0.6, 0.9, 0)
        assert sampled(path, temperature=0.3, top_p=0.5) == (0.3, 0.5, 0)
    state.config = ServerConfig(temperature_default=0.0, top_k_default=5)
    for path in bodies:
        assert sampled(path) == (0.0, 0.9, 5)
        if path != "/v1/responses":  # the Responses API has no top_k
            assert sampled(path, temperature=1.0, top_k=2) == (1.0, 0.9, 2)
    engine.tok = tokenizer_without_defaults = Tokenizer.load(_plain(tmp_path))
    state.set_ready(ReadyEngine(engine, tokenizer_without_defaults, "m", 4096))
    state.config = ServerConfig()
    assert sampled("/v1/chat/completions") == (1.0, 1.0, 0)


def _plain(tmp_path):
    folder = tmp_path / "plain"
    folder.mkdir()
    write_tiny_tokenizer(folder)
    return folder


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_across_a_utf8_boundary_is_never_sent(
    tokenizer: Tokenizer, stream: bool
) -> None:
    engine = ScriptedEngine(tokenizer, "naïve café—done")
    c, _ = make(tokenizer, engine)
    r = c.simulate_post(
        "/v1/completions", json={"model": "m", "prompt": "x", "stop": ["é—"], "stream": stream}
    )
    if stream:
        events = [
            json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: {")
        ]
        text = "".join(e["choices"][0]["text"] for e in events)
        assert (
            r.text.rstrip().endswith("data: [DONE]")
            and events[-1]["choices"][0]["finish_reason"] == "stop"
        )
    else:
        text, reason = r.json["choices"][0]["text"], r.json["choices"][0]["finish_reason"]
        assert reason == "stop"
    assert text == "naïve caf"
    assert engine.cancelled  # the stop cancelled the sequence


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_failure_answers_in_each_endpoints_own_error_shape(
    tokenizer: Tokenizer, stream: bool
) -> None:
    engine = ScriptedEngine(tokenizer, "ab", reason="error")
    c, state = make(tokenizer, engine)
    msgs = [{"role": "user", "content": "x"}]
    for path, body in (
        ("/v1/chat/completions", chat()),
        ("/v1/completions", {"model": "m", "prompt": "x"}),
        ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": msgs}),
        ("/v1/responses", {"model": "m", "input": "x"}),
    ):
        r = c.simulate_post(path, json={**body, "stream": stream})
        if not stream:
            assert r.status_code == 500, (path, r.text)
            err = r.json["error"]
            assert (
                err["type"] == "api_error"
                if path == "/v1/messages"
                else err["code"] == "engine_error"
            ), (path, r.json)
            continue
        events = [e for e in r.text.split("\n\n") if e.strip()]
        # the error, then the stream's end (as vLLM sends them)
        if path in (
            "/v1/chat/completions",
            "/v1/completions",
        ):
            assert (
                json.loads(events[-2][6:])["error"]["code"] == "engine_error"
                and events[-1] == "data: [DONE]"
            ), (path, events)
        else:
            kind, data = events[-1].split("\n")
            error = json.loads(data[6:])
            assert kind == "event: error" and error["type"] == "error", (path, events)
            assert (
                error["error"]["type"] == "api_error"
                if path == "/v1/messages"
                else error["code"] == "engine_error"
            )
    assert (
        state.metrics.snapshot()["completion_tokens"] == 0
    )  # a failed answer counts no completion


def test_chat_stream_shape_matches_the_openai_client(tokenizer: Tokenizer) -> None:
    c, _ = make(tokenizer, ScriptedEngine(tokenizer, "hey"))
    r = c.simulate_post(
        "/v1/chat/completions",
        json=chat(
            stream=True, n=2, stream_options={"include_usage": True}, logprobs=True, top_logprobs=1
        ),
    )
    assert (
        r.headers["content-type"] == "text/event-stream"
        and r.headers["cache-control"] == "no-cache"
    )
    events = [json.loads(p[6:]) for p in r.text.split("\n\n") if p.startswith("data: {")]
    assert {e["choices"][0]["delta"].get("role") for e in events[:2]} == {"assistant"}
    assert all(e["usage"] is None for e in events[:-1]) and events[-1]["choices"] == []
    assert (
        events[-1]["usage"]["completion_tokens"] == 6
        and events[-1]["usage"]["prompt_tokens"] == events[-1]["usage"]["total_tokens"] - 6
    )
    finishes = [e["choices"][0] for e in events[:-1] if e["choices"][0]["finish_reason"]]
    assert sorted(f["index"] for f in finishes) == [0, 1] and all(
        f["delta"] == {} for f in finishes
    )
    contents = [
        e["choices"][0] for e in events if e["choices"] and e["choices"][0]["delta"].get("content")
    ]
    assert all(ch["logprobs"]["content"][0]["top_logprobs"] for ch in contents)
    assert "system_fingerprint" not in events[0]


def test_request_id_is_echoed_and_bound_in_logs(tokenizer: Tokenizer) -> None:
    c, _ = make(tokenizer, ScriptedEngine(tokenizer, "ok"))
    r = c.simulate_get("/v1/models", headers={"X-Request-Id": "my-id.1"})
    assert r.headers["x-request-id"] == "my-id.1"
    assert (
        c.simulate_get("/v1/models", headers={"X-Request-Id": "bad id\n"})
        .headers["x-request-id"]
        .startswith("req-")
    )
    with capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        c, _ = make(tokenizer, ScriptedEngine(tokenizer, error=RuntimeError("boom")))
        r = c.simulate_post("/v1/chat/completions", json=chat(), headers={"X-Request-Id": "rid-7"})
    assert r.status_code == 500 and r.json["error"]["code"] == "internal_error"
    assert any(e.get("request_id") == "rid-7" and e["event"] == "request_failed" for e in logs)


def test_metrics_are_prometheus_text(tokenizer: Tokenizer) -> None:
    c, _ = make(tokenizer, ScriptedEngine(tokenizer, "ok"))
    c.simulate_post("/v1/chat/completions", json=chat())
    assert c.simulate_post("/v1/responses", json={"model": "m", "input": "hi"}).status_code == 200
    assert (
        c.simulate_post("/v1/messages", json={"model": "m", "max_tokens": 8, **chat()}).status_code
        == 200
    )
    text = c.simulate_get("/metrics").text
    assert (
        "# TYPE deltafind_step_seconds histogram" in text
        and 'deltafind_step_seconds_bucket{le="+Inf"} 0' in text
    )
    # each route counted under its own name
    for endpoint in (
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/messages",
    ):
        assert f'deltafind_http_requests_total{{endpoint="{endpoint}",status="200"}} 1' in text
