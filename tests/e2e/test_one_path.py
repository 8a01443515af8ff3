"""One engine path: a greedy request gives the same tokens through the Python API, `deltafind run`,
`deltafind bench` and the live daemon, with drafting off and with the n-gram draft.

The API and `bench --json` give token ids; `run` prints the text and the daemon answers with
text and a token count, compared with the decoded ids.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deltafind import Model
from tests.conftest import deltafind_cmd
from tests.e2e.daemon_fixtures import Daemon

PROMPT = "red green blue, red green blue, red green blue, red"
N = 16


@pytest.mark.parametrize("draft", ["off", "ngram"])
def test_api_run_bench_and_daemon_give_the_same_greedy_tokens(demo_store: Path, draft: str) -> None:
    model = Model.open(demo_store, draft=draft)
    try:
        ids = model.tokenizer.encode(PROMPT)
        tokens = model.generate(ids, max_new_tokens=N)
        text = model.tokenizer.decode(tokens, skip_special_tokens=True)
        assert len(tokens) == N and not set(tokens) & set(
            model.eos_token_ids
        )  # bench ignores EOS: none may come
        if draft == "ngram":
            assert model.last_draft_stats.proposed > 0  # the draft ran
    finally:
        model.close()

    run = deltafind_cmd(
        "run", "--store", str(demo_store), "--prompt", PROMPT, "--max-new", str(N), "--draft", draft
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == text + "\n"

    bench = deltafind_cmd(
        "bench",
        "--store",
        str(demo_store),
        "--prompt",
        PROMPT,
        "--new-tokens",
        str(N),
        "--json",
        "--draft",
        draft,
    )
    assert bench.returncode == 0, bench.stderr
    result = json.loads(bench.stdout)
    assert result["token_ids"] == tokens
    assert (
        (result["draft"] or {}).get("proposed", 0) > 0
        if draft == "ngram"
        else result["draft"] is None
    )
    assert result["snapshot"]["engine"]["generated_tokens"] == N

    mode = "off" if draft == "off" else f'on"\nsource = "{draft}'
    d = Daemon(demo_store, f'[draft]\nmode = "{mode}"\n').start()
    try:
        status, body = d.post_json(
            "/v1/completions",
            {"model": "test-model", "prompt": PROMPT, "max_tokens": N, "temperature": 0},
        )
        assert status == 200, body
        assert body["choices"][0]["text"] == text and body["usage"]["completion_tokens"] == N
        snap = json.loads(d.ctl("--json", "status").stdout)["snapshot"]["engine"]
        assert snap["draft"]["proposed"] > 0 if draft == "ngram" else snap["draft_mode"] == "off"
        assert snap["histograms"]["time_to_first_token_seconds"]["count"] >= 1
    finally:
        assert d.stop() == 0
        d.cleanup()
