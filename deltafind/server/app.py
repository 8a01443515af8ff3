"""The Falcon WSGI app: routes, API keys, request ids, readiness.

`create_app(state)` serves /v1/models, /v1/chat/completions, /v1/completions,
/v1/responses, /v1/messages and /v1/messages/count_tokens (Anthropic), /health, /metrics and `/`. The app starts before the model is loaded: until the
daemon hands `state` a `ReadyEngine`, model routes answer 503 model_loading.
Holds an engine client (submit/status) and a tokenizer, nothing deeper.
"""

from __future__ import annotations

import hmac
import re
import uuid
from typing import Any

import falcon
import structlog

from deltafind.log import get_logger
from deltafind.server import errors
from deltafind.server import metrics as prom
from deltafind.server.errors import ApiError
from deltafind.server.lifecycle import AppState, ReadyEngine
from deltafind.server.messages import Messages
from deltafind.server.openai import Generate
from deltafind.server.responses import Responses

log = get_logger(__name__)
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
OPEN_PATHS = ("/health", "/")  # probes: Claude Code sends `HEAD /` without its key


class _Resource:
    """Holds the state that a resource (or the middleware) reads per request."""

    def __init__(self, state: AppState) -> None:
        self.state = state


class RequestContext(_Resource):
    """Per request: bind a request id (echoed as X-Request-Id), check the API key, count."""

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        structlog.contextvars.clear_contextvars()  # gthread reuses threads
        given = req.get_header("X-Request-Id") or ""
        rid = given if _REQUEST_ID.fullmatch(given) else "req-" + uuid.uuid4().hex[:20]
        structlog.contextvars.bind_contextvars(request_id=rid)
        req.context.request_id = rid
        resp.set_header("X-Request-Id", rid)
        keys = self.state.config.api_keys
        if keys and req.path not in OPEN_PATHS:
            check_key(req.get_header("Authorization"), req.get_header("X-Api-Key"), keys)

    def process_response(
        self, req: falcon.Request, resp: falcon.Response, resource: Any, req_succeeded: bool
    ) -> None:
        self.state.metrics.count_request(req.path, str(resp.status))


def check_key(header: str | None, api_key: str | None, keys: tuple[str, ...]) -> None:
    """`Authorization: Bearer KEY` (OpenAI) or `x-api-key: KEY` (Anthropic): either is one of `keys`."""
    scheme, _, token = (header or "").partition(" ")
    given = [token.strip()] if scheme.lower() == "bearer" else []
    if api_key is not None:
        given.append(api_key.strip())
    ok = False
    for t in given or [""]:
        for key in keys:  # every key, every time: the time taken does not depend on which matched
            ok |= hmac.compare_digest(t.encode(), key.encode())
    if not ok:
        raise ApiError(
            401,
            "Incorrect or missing API key: send `Authorization: Bearer KEY` or `x-api-key: KEY`.",
            None,
            "invalid_api_key",
            {"WWW-Authenticate": "Bearer"},
        )


class Health(_Resource):
    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        s = self.state
        draining = s.engine is not None and s.engine.client.draining
        status = "draining" if draining else s.load_status
        down = [
            n["rank"]
            for n in (s.engine.nodes() if status == "ready" and s.engine else ())
            if not n["alive"]
        ]
        drives = s.engine.drive_problems() if status == "ready" and s.engine else []
        resp.status = 200 if status == "ready" else 503
        if down or drives:  # still serving what the live nodes and readable packs hold
            resp.media = {
                "status": "degraded",
                "model": s.model_name,
                **({"nodes_down": down} if down else {}),
                **({"drives": drives} if drives else {}),
            }
            return
        resp.media = {
            "status": status,
            "model": s.model_name,
            **({"error": s.load_error} if s.load_error else {}),
        }
        if status == "loading":
            resp.set_header("Retry-After", "5")

    on_head = on_get  # load balancers probe with HEAD; falcon sends the headers only


class Root(_Resource):
    """`/`: what answers here. Clients probe it before their first request (Claude Code sends `HEAD /`)."""

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.media = {
            "object": "deltafind",
            "model": self.state.model_name,
            "status": self.state.load_status,
            "endpoints": [
                "/v1/models",
                "/v1/chat/completions",
                "/v1/completions",
                "/v1/responses",
                "/v1/messages",
                "/v1/messages/count_tokens",
                "/health",
                "/metrics",
            ],
        }

    on_head = on_get


class Models(_Resource):
    def _card(self, e: ReadyEngine, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": e.created, "owned_by": "deltafind"}

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        e = self.state.require_ready()
        resp.media = {
            "object": "list",
            "data": [self._card(e, n) for n in (e.model_name, *e.aliases)],
        }

    def on_get_one(self, req: falcon.Request, resp: falcon.Response, model: str) -> None:
        e = self.state.require_ready()
        if model != e.model_name and model not in e.aliases:
            raise ApiError(404, f"The model `{model}` does not exist", "model", "model_not_found")
        resp.media = self._card(e, model)


class Metrics(_Resource):
    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        s = self.state
        engine, store = None, None
        if s.engine is not None:
            engine = s.engine.client.snapshot()
            try:
                store = s.engine.store_snapshot()
            except Exception:  # a figure that cannot be read must not take /metrics down
                log.exception("metrics_failed")
        resp.content_type = prom.CONTENT_TYPE
        resp.text = prom.render(s.metrics.snapshot(), s.engine is not None, engine, store)


def create_app(state: AppState) -> falcon.App:
    app = falcon.App(middleware=[RequestContext(state)], cors_enable=False)
    app.req_options.strip_url_path_trailing_slash = True
    errors.install(app)
    app.add_route("/", Root(state))
    app.add_route("/health", Health(state))
    app.add_route("/metrics", Metrics(state))
    models = Models(state)
    app.add_route("/v1/models", models)
    app.add_route("/v1/models/{model}", models, suffix="one")
    app.add_route("/v1/chat/completions", Generate(state, chat=True))
    app.add_route("/v1/completions", Generate(state, chat=False))
    responses = Responses(state)
    app.add_route("/v1/responses", responses)
    app.add_route("/v1/responses/input_tokens", responses, suffix="input_tokens")
    messages = Messages(state)
    app.add_route("/v1/messages", messages)
    app.add_route("/v1/messages/count_tokens", messages, suffix="count_tokens")
    return app
