"""The OpenAI-compatible HTTP API (Falcon WSGI): routes, schemas, SSE, metrics.

Talks to the engine only through its client (submit/cancel/status) and to text
through the tokenizer; never imports models or store. `daemon` wires it up.
"""

from deltafind.server.app import create_app
from deltafind.server.lifecycle import AppState, ReadyEngine, ServerConfig

__all__ = ["AppState", "ReadyEngine", "ServerConfig", "create_app"]
