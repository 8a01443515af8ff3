"""Bytes a streaming GGUF install fetches against the bytes its experts need.

The split qwen3moe GGUF of tests/unit/test_hub_gguf.py (3 layers of 8 experts, Q4_K/IQ4_XS/IQ2_XXS/Q6_K,
~37-50 KB per expert tensor) on the loopback hub: `setup --streaming`, 8 greedy tokens that fetch
their experts on demand, then `setup --fill` (whose count includes the bytes it reads only to check
each shard's sha256: headers and spine). Prints one JSON line. Run: python tests/bench/bench_gguf_fetch.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `tests.` below, run as a script

from tests.conftest import deltafind_cmd
from tests.gguf_models import make_qwen3moe
from tests.hub_server import TOKEN, FakeHub
from tests.unit.test_hub_gguf import GENERATE, MOE, MOE_SHARDS, PROMPT_IDS


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="bench-gguf-fetch-"))
    (root / "repo").mkdir()
    make_qwen3moe(seed=3).write(root / "repo" / "moe-Q4_K_M.gguf", shards=2)
    with FakeHub({MOE: root / "repo"}) as hub:
        env = {
            "HF_ENDPOINT": hub.endpoint,
            "HF_TOKEN": TOKEN,
            "HF_HUB_OFFLINE": "0",
            "HF_HOME": str(root / "hf"),
        }
        store = root / "s"
        args = ("--from", f"{MOE}:Q4_K_M", "--store", str(store), "--streaming", "--quiet")
        proc = deltafind_cmd("setup", *args, env=env)
        assert proc.returncode == 0, proc.stderr
        meta = json.loads((store / "remote.json").read_text())
        parts = {(layer, e): p for layer, e, p in meta["experts"]}

        def ranges() -> list:
            return [r for n in MOE_SHARDS for r in hub.requests(n) if r.range]

        hub.log.clear()
        proc = subprocess.run(
            [sys.executable, "-c", GENERATE.format(ids=PROMPT_IDS), str(store)],
            capture_output=True,
            text=True,
            env={**os.environ, **env},
        )
        assert proc.returncode == 0, proc.stderr
        lines = (store / "present.jsonl").read_text().splitlines()
        have = {(d["layer"], d["expert"]) for d in map(json.loads, lines)}
        decode = {
            "experts": len(have),
            "needed_bytes": sum(b - a for k in have for _, a, b in parts[k]),
            "fetched_bytes": sum(r.sent for r in ranges()),
            "requests": len(ranges()),
        }
        hub.log.clear()
        proc = deltafind_cmd("setup", "--fill", "--store", str(store), "--quiet", env=env)
        assert proc.returncode == 0, proc.stderr
        fill = {
            "experts": len(parts) - len(have),
            "needed_bytes": sum(b - a for k in parts if k not in have for _, a, b in parts[k]),
            "fetched_bytes_with_sha_check": sum(r.sent for r in ranges()),
        }
    print(json.dumps({"decode": decode, "fill": fill}))


if __name__ == "__main__":
    main()
