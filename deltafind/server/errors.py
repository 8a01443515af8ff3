"""API errors: one exception type and the falcon handlers that render it in the caller's API's shape.

Every failure a client sees is `{"error": {"message", "type", "param", "code"}}`
with the status the official client expects (400 bad request, 401 key, 404
model/route, 413 body, 429 busy, 503 loading/draining, 500 a bug); under
/v1/messages (Anthropic) it is `{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import json
from typing import Any

import falcon

from deltafind.log import get_logger

log = get_logger(__name__)

TYPES = {
    401: "authentication_error",
    403: "permission_error",
    429: "rate_limit_error",
}  # else by class: 4xx, 5xx
# Anthropic's error types by status; any other status is invalid_request_error (4xx) or api_error.
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
ANTHROPIC_PREFIX = "/v1/messages"


class ApiError(Exception):
    """A request that fails with an OpenAI-shaped error body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        type_: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}
        self.type = type_ or TYPES.get(
            status, "invalid_request_error" if status < 500 else "server_error"
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def anthropic_body(self) -> dict[str, Any]:
        kind = ANTHROPIC_TYPES.get(
            self.status, "invalid_request_error" if self.status < 500 else "api_error"
        )
        return {"type": "error", "error": {"type": kind, "message": self.message}}


def is_anthropic(path: str) -> bool:
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


def handle_api_error(
    req: falcon.Request, resp: falcon.Response, ex: ApiError, params: dict
) -> None:
    resp.status = ex.status
    resp.content_type = falcon.MEDIA_JSON
    resp.text = json.dumps(ex.anthropic_body() if is_anthropic(req.path) else ex.body())
    for k, v in ex.headers.items():
        resp.set_header(k, v)


def handle_http_error(
    req: falcon.Request, resp: falcon.Response, ex: falcon.HTTPError, params: dict
) -> None:
    status = ex.status_code
    message = ex.description or ex.title or "request failed"
    if status == 404 and is_anthropic(req.path):
        message = f"no route {req.method} {req.path}; see /v1/messages, /v1/messages/count_tokens"
    elif status == 404:
        message = f"no route {req.method} {req.path}; see /v1/models, /v1/chat/completions, /v1/completions"
    elif status == 405:
        message = f"method {req.method} is not allowed on {req.path}"
    code = None if status >= 500 else "invalid_request"
    handle_api_error(
        req, resp, ApiError(status, message, None, code, dict(ex.headers or {})), params
    )


def handle_unexpected(
    req: falcon.Request, resp: falcon.Response, ex: Exception, params: dict
) -> None:
    log.exception("request_failed", method=req.method, path=req.path)
    handle_api_error(
        req,
        resp,
        ApiError(
            500, f"internal error: {type(ex).__name__}; see the server log", None, "internal_error"
        ),
        params,
    )


def install(app: falcon.App) -> None:
    app.add_error_handler(Exception, handle_unexpected)
    app.add_error_handler(falcon.HTTPError, handle_http_error)
    app.add_error_handler(ApiError, handle_api_error)
