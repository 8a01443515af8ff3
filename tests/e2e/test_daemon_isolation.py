"""One request's sampling values never touch another's, against the real daemon.

`"top_p": 1e-300` and `"temperature": 1e-320` are valid input; they once rounded to 0 in
float32, gave a 500 and failed every other request of the same engine step. Three concurrent
greedy streams plus such a request must give the same three texts as without it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.daemon_fixtures import Daemon, tiny_store_fixture  # noqa: F401  (the tiny_store fixture)

PROMPTS = ["Once upon a time", "The capital of France is", "red green blue, red green"]


@pytest.fixture(scope="module")
def daemon(tiny_store: Path) -> Iterator[Daemon]:
    d = Daemon(tiny_store, "[server]\nmax_running = 8\n").start()
    yield d
    assert d.stop() == 0
    d.cleanup()


def _together(daemon: Daemon, bodies: list[dict]) -> list[tuple[int, dict]]:
    out: list[tuple[int, dict]] = [(0, {})] * len(bodies)

    def one(i: int) -> None:
        out[i] = daemon.post_json(
            "/v1/completions", {"model": "test-model", **bodies[i]}, timeout=120
        )

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    return out


@pytest.mark.parametrize(
    "poison",
    [
        {"top_p": 1e-300, "temperature": 1.0},
        {"temperature": 1e-320},
        {"temperature": 5e-324, "top_p": 5e-324},
    ],
    ids=["top_p", "temperature", "both"],
)
def test_three_greedy_streams_plus_a_subnormal_sampling_request_keep_their_texts(
    daemon: Daemon, poison: dict
) -> None:
    greedy = [{"prompt": p, "max_tokens": 24, "temperature": 0} for p in PROMPTS]
    alone = _together(daemon, greedy)
    assert all(status == 200 for status, _ in alone), alone
    got = _together(
        daemon, [greedy[0], {"prompt": "Hello", "max_tokens": 24, "seed": 1, **poison}, *greedy[1:]]
    )
    assert [status for status, _ in got] == [200] * 4, got
    texts = [body["choices"][0]["text"] for _, body in got]
    assert texts[:1] + texts[2:] == [body["choices"][0]["text"] for _, body in alone]
    assert got[1][1]["usage"]["completion_tokens"] > 0
