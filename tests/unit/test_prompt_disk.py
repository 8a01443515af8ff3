"""Prompt state on disk: prefix-cache entries written by one engine are read back by the next.

On a synthetic K3 store (KDA + MLA: recurrent state and snapshots) and on qwen3_moe (attention
only). A new engine over the same folder stands for a daemon restart: the same prompt reuses all
but its last token from the file and gives the tokens a cold prefill gives; a file whose bytes
or key (model, store, template, format) changed is deleted with a log line, never used; the
files stay within their byte budget.
"""

from __future__ import annotations

from pathlib import Path

from structlog.testing import capture_logs

from deltafind import Model
from deltafind.engine.core import EngineCore
from deltafind.engine.prompt_disk import SUFFIX, PromptDisk
from tests.unit.test_prefix_checkpoint import (
    HISTORY,
    NEW,
    TAIL,
    _core,
    _request,
    _run,
    _same_tokens_as_cold,
)
from tests.unit.test_prefix_checkpoint import model as model  # the K3 and qwen3_moe stores

IDENTITY = {"family": "test", "manifest": "m1", "chat_template": "t1", "dtype": "float32"}


def _engine(
    model: Model,
    folder: Path,
    identity: dict[str, str] = IDENTITY,
    disk_bytes: int = 1 << 30,
    memory_bytes: int = 1 << 26,
) -> EngineCore:
    core = _core(model, snapshot_tokens=8, cache_bytes=memory_bytes)
    core.prefix.disk = PromptDisk(folder, disk_bytes, identity)
    return core


def test_a_restart_reuses_the_prompt_from_disk_with_identical_tokens(
    model: Model, tmp_path: Path
) -> None:
    prompt = [*HISTORY, *TAIL]
    first = _engine(model, tmp_path)
    events1, _ = _run(first, _request(prompt, len(HISTORY)))
    first.prefix.disk.flush()
    [path] = tmp_path.glob(f"*{SUFFIX}")
    after = _engine(model, tmp_path)  # a restarted daemon: nothing in memory
    assert len(after.prefix) == 0 and len(after.prefix.disk) == 1
    events2, fin = _run(after, _request(prompt, len(HISTORY)))
    assert fin.cached_tokens == len(prompt) - 1
    assert [e.token_id for e in events2] == [e.token_id for e in events1]
    _same_tokens_as_cold(model.net, prompt, events2)
    # another session sharing the history (other text after it) resumes from the same file (K3: the history-end snapshot)
    other = _engine(model, tmp_path)
    edited = [*HISTORY, *NEW]
    events3, fin = _run(other, _request(edited, 0))
    assert fin.cached_tokens == len(HISTORY)
    _same_tokens_as_cold(model.net, edited, events3)
    assert path.exists()


def test_a_corrupt_or_stale_file_is_dropped_with_a_log_line(model: Model, tmp_path: Path) -> None:
    prompt = [*HISTORY, *TAIL]
    first = _engine(model, tmp_path)
    _run(first, _request(prompt, 0))
    first.prefix.disk.flush()
    [path] = tmp_path.glob(f"*{SUFFIX}")
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF  # a flipped bit in the tensor data (the header still parses)
    path.write_bytes(bytes(raw))
    with capture_logs() as logs:
        after = _engine(model, tmp_path)
        events, fin = _run(after, _request(prompt, 0))
    assert fin.cached_tokens == 0
    _same_tokens_as_cold(model.net, prompt, events)
    dropped = [e for e in logs if e["event"] == "prompt_disk_dropped"]
    assert (
        len(dropped) == 1 and "checksum" in dropped[0]["reason"] and dropped[0]["file"] == str(path)
    )
    after.prefix.disk.flush()  # the run just now wrote a good file again
    assert path.exists()
    with capture_logs() as logs:
        changed = _engine(
            model, tmp_path, {**IDENTITY, "chat_template": "t2"}
        )  # the template changed
    assert [e["reason"].split(":")[0] for e in logs if e["event"] == "prompt_disk_dropped"] == [
        "stale"
    ]
    assert len(changed.prefix.disk) == 0 and not path.exists()


def test_files_stay_within_the_byte_budget(model: Model, tmp_path: Path) -> None:
    core = _engine(model, tmp_path)
    _run(core, _request([*HISTORY, *TAIL], 0))
    core.prefix.disk.flush()
    one = core.prefix.disk.used_bytes
    small = _engine(model, tmp_path / "small", disk_bytes=int(one * 1.5))
    for head in (1, 2, 3):  # three unrelated prompts: the oldest file goes
        _run(small, _request([head, *HISTORY, *TAIL], 0))
        small.prefix.disk.flush()
    assert 0 < small.prefix.disk.used_bytes <= int(one * 1.5) and len(small.prefix.disk) == 1
    assert (
        sum(p.stat().st_size for p in (tmp_path / "small").glob(f"*{SUFFIX}"))
        == small.prefix.disk.used_bytes
    )


def test_an_entry_too_big_for_memory_still_goes_to_disk(model: Model, tmp_path: Path) -> None:
    prompt = [*HISTORY, *TAIL]
    first = _engine(model, tmp_path, memory_bytes=1)  # the drive's budget is the larger one
    events1, _ = _run(first, _request(prompt, 0))
    first.prefix.disk.flush()
    assert len(first.prefix) == 0 and len(first.prefix.disk) == 1
    after = _engine(model, tmp_path, memory_bytes=1)
    events2, fin = _run(after, _request(prompt, 0))
    assert fin.cached_tokens == len(prompt) - 1 and [e.token_id for e in events2] == [
        e.token_id for e in events1
    ]
