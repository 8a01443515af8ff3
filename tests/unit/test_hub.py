"""`setup --from ORG/NAME` against a loopback hub (tests/hub_server.py), no network.

The hub serves a tiny sharded qwen3_moe checkpoint as huggingface.co does; the real
`deltafind` runs as a subprocess with HF_ENDPOINT pointed at it. Stores made from the
hub are compared with the import of the same folder from disk (the independent
reference): same spine and expert sha256s, same greedy token ids.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from deltafind.importer.setup import setup_store
from deltafind.store.doctor import check_store
from deltafind.store.manifest import Manifest
from tests.conftest import deltafind_cmd, make_hf_checkpoint
from tests.hub_server import COMMIT, TOKEN, FakeHub

REPO = "org/tiny"
SHARDS = [f"model-{i:05d}-of-00003.safetensors" for i in (1, 2, 3)]
PROMPT_IDS = [104, 101, 108, 108, 111, 32]
GENERATE = "import sys; from deltafind import Model; m = Model.open(sys.argv[1]); print(m.generate({ids}, max_new_tokens=8))"
STATUS = (
    "import json, sys; from deltafind import Model; from deltafind.control.ctl import store_lines; "
    "s = Model.open(sys.argv[1]).snapshot(); print(json.dumps([s['store_bytes_present'], s['store_bytes_total'], store_lines(s)]))"
)


def _shard(folder: Path) -> None:
    """Re-save the checkpoint as 3 shards in name order (an expert's tensors may straddle two)."""
    single = folder / "model.safetensors"
    tensors = load_file(single)
    single.unlink()
    names = sorted(tensors)
    per = -(-len(names) // len(SHARDS))
    weight_map = {}
    for i, fname in enumerate(SHARDS):
        part = {n: tensors[n].contiguous() for n in names[i * per : (i + 1) * per]}
        save_file(part, folder / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = make_hf_checkpoint(
        "qwen3_moe",
        tmp_path_factory.mktemp("hub") / "tiny",
        mlp_only_layers=[0],
        norm_topk_prob=True,
    )
    _shard(folder)
    (folder / "README.md").write_text("a model card setup must not download\n")
    (folder / "pytorch_model.bin").write_bytes(
        b"\0" * 4096
    )  # another format setup must not download
    return folder


@pytest.fixture(scope="module")
def reference(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Manifest, list[int]]:
    """The same folder imported from disk, and its greedy tokens."""
    store = tmp_path_factory.mktemp("ref") / "store"
    manifest = setup_store(ckpt, store, progress=False)
    return manifest, _generate(store, {})


@pytest.fixture(scope="module")
def hub(ckpt: Path) -> FakeHub:
    with FakeHub({REPO: ckpt}) as h:
        yield h


@pytest.fixture()
def env(hub: FakeHub, tmp_path: Path) -> dict[str, str]:
    hub.faults.__init__()
    hub.log.clear()
    return {
        "HF_ENDPOINT": hub.endpoint,
        "HF_TOKEN": TOKEN,
        "HF_HUB_OFFLINE": "0",
        "HF_HOME": str(tmp_path / "hf-home"),
    }


def _generate(store: Path, env: dict[str, str]) -> list[int]:
    proc = subprocess.run(
        [sys.executable, "-c", GENERATE.format(ids=PROMPT_IDS), str(store)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _status(store: Path, env: dict[str, str]) -> list:
    proc = subprocess.run(
        [sys.executable, "-c", STATUS, str(store)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _setup(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    proc = deltafind_cmd("setup", *args, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc


def _same_store(store: Path, reference: tuple[Manifest, list[int]]) -> None:
    ref, got = reference[0], Manifest.load(store)
    assert got.spine_sha256 == ref.spine_sha256
    assert [(r.key, r.sha256) for r in got.experts] == [(r.key, r.sha256) for r in ref.experts]


def _blobs(env: dict[str, str]) -> list[Path]:
    blobs = Path(env["HF_HOME"]) / "hub" / "models--org--tiny" / "blobs"
    return [p for p in blobs.iterdir() if p.stat().st_size > 100_000] if blobs.is_dir() else []


def test_download_equals_the_local_import_and_skips_what_the_store_does_not_need(
    hub: FakeHub, env: dict[str, str], reference, tmp_path: Path
) -> None:
    proc = _setup(env, "--from", f"{REPO}@main", "--store", str(tmp_path / "s"))
    _same_store(tmp_path / "s", reference)
    assert (
        Manifest.load(tmp_path / "s").source["source"] == f"hf:{REPO}@{COMMIT}"
    )  # the revision is pinned to its commit
    fetched = {
        r.path.rsplit("/", 1)[-1]
        for r in hub.log
        if r.method == "GET" and "/resolve/" in r.path and r.range in (None, "bytes=0-")
    }
    assert set(SHARDS) <= fetched and not fetched & {"README.md", "pytorch_model.bin"}
    assert "B/s" in proc.stderr  # huggingface_hub's progress: bytes, rate, ETA
    # Offline, the same repo id comes from the HF cache without a request.
    hub.log.clear()
    _setup(
        {**env, "HF_HUB_OFFLINE": "1"},
        "--from",
        REPO,
        "--store",
        str(tmp_path / "offline"),
        "--quiet",
    )
    _same_store(tmp_path / "offline", reference)
    assert hub.log == []


def test_dropped_connections_and_a_corrupt_byte_are_survived(
    hub: FakeHub, env: dict[str, str], reference, tmp_path: Path, ckpt: Path
) -> None:
    hub.faults.drop_after[SHARDS[0]] = 50_000
    hub.faults.corrupt_at[SHARDS[1]] = (ckpt / SHARDS[1]).stat().st_size - 1000
    proc = _setup(env, "--from", REPO, "--store", str(tmp_path / "s"))
    _same_store(tmp_path / "s", reference)
    whole = [r for r in hub.requests(SHARDS[0]) if r.range and r.range.endswith("-")]
    assert (
        whole[0].sent == 50_000 and int(whole[1].range[len("bytes=") : -1]) == 50_000
    )  # cut short, then only the rest
    assert "sha256" in proc.stderr and "downloading it again" in proc.stderr
    assert [r.range for r in hub.requests(SHARDS[1]) if r.range and r.range.endswith("-")] == [
        "bytes=0-",
        "bytes=0-",
    ]


def test_a_killed_download_resumes(
    hub: FakeHub, env: dict[str, str], reference, tmp_path: Path, ckpt: Path
) -> None:
    size = (ckpt / SHARDS[0]).stat().st_size
    hub.faults.rate_bytes_s = 100_000
    exe = Path(sys.executable).with_name("deltafind")
    proc = subprocess.Popen(
        [str(exe), "setup", "--from", REPO, "--store", str(tmp_path / "s"), "--quiet"],
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    blobs = Path(env["HF_HOME"]) / "hub" / "models--org--tiny" / "blobs"
    deadline = time.monotonic() + 120
    while not [p for p in blobs.glob("*.deltafind-partial") if p.stat().st_size >= 100_000]:
        assert proc.poll() is None and time.monotonic() < deadline, (
            "setup ended before it could be killed"
        )
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    hub.faults.rate_bytes_s = None
    hub.log.clear()
    _setup(env, "--from", REPO, "--store", str(tmp_path / "s"), "--quiet")
    _same_store(tmp_path / "s", reference)
    first = next(r for r in hub.requests(SHARDS[0]) if r.range and r.range.endswith("-"))
    assert int(first.range[len("bytes=") : -1]) >= 100_000 and first.sent == size - int(
        first.range[len("bytes=") : -1]
    )  # only the rest


def test_delete_source_frees_each_shard(env: dict[str, str], reference, tmp_path: Path) -> None:
    _setup(env, "--from", REPO, "--store", str(tmp_path / "s"), "--delete-source", "--quiet")
    _same_store(tmp_path / "s", reference)
    assert _blobs(env) == []  # no shard left in the HF cache
    assert not (tmp_path / "s" / ".hub-staging").exists()


def test_a_wrong_token_or_repo_is_named(env: dict[str, str], tmp_path: Path) -> None:
    proc = deltafind_cmd(
        "setup", "--from", REPO, "--store", str(tmp_path / "s"), env={**env, "HF_TOKEN": "hf_wrong"}
    )
    assert proc.returncode != 0 and "HF_TOKEN" in proc.stderr and REPO in proc.stderr
    proc = deltafind_cmd("setup", "--from", f"{REPO}@nope", "--store", str(tmp_path / "s"), env=env)
    assert proc.returncode != 0 and "no such revision" in proc.stderr


@pytest.fixture(scope="module")
def streaming_store(hub: FakeHub, ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("streaming")
    env = {
        "HF_ENDPOINT": hub.endpoint,
        "HF_TOKEN": TOKEN,
        "HF_HUB_OFFLINE": "0",
        "HF_HOME": str(root / "hf-home"),
    }
    _setup(env, "--from", REPO, "--store", str(root / "s"), "--streaming", "--quiet")
    return root / "s"


def _copy(store: Path, tmp_path: Path) -> Path:
    shutil.copytree(store, tmp_path / "s")
    return tmp_path / "s"


def test_streaming_install_answers_with_the_same_tokens(
    hub: FakeHub, env: dict[str, str], reference, streaming_store: Path, tmp_path: Path
) -> None:
    from deltafind.importer.hub_streaming import open_fetcher

    store = _copy(streaming_store, tmp_path)
    manifest = Manifest.load(store)
    fetcher = open_fetcher(store, manifest)
    dense = sum(
        r.length for r in manifest.experts if r.layer == 0
    )  # layer 0's dense slices come with the install
    assert fetcher.present_bytes() == dense < fetcher.total_bytes()
    fetcher.close()
    present, total, lines = _status(store, env)  # the store snapshot `deltafinctl status` renders
    assert (present, total) == (dense, manifest.expert_bytes())
    assert any(line.startswith("store      streaming install:") for line in lines), lines
    assert not _blobs(env)  # nothing was downloaded whole
    hub.faults.drop_after[SHARDS[1]] = (
        3000  # the first range of that shard is cut short, then retried
    )
    assert _generate(store, env) == reference[1]
    gets = [r for f in SHARDS for r in hub.requests(f) if r.range]
    expert_bytes = max(
        r.length for r in manifest.experts if r.layer > 0
    )  # a routed expert (layer 0 is dense)
    assert any(
        int(r.range.split("-")[1]) - int(r.range.split("=")[1].split("-")[0]) > expert_bytes
        for r in gets
    )  # coalesced
    fetcher = open_fetcher(store, Manifest.load(store))
    assert fetcher.present_bytes() > dense
    missing = len(fetcher.missing())
    fetcher.close()
    hub.log.clear()
    assert _generate(store, env) == reference[1]
    report = check_store(store, progress=False)  # doctor checks what is on disk, fetches nothing
    assert report.ok and report.experts_checked == len(Manifest.load(store).experts) - missing
    assert not [r for r in hub.log if "/resolve/" in r.path]  # later reads are local


def test_an_interrupted_streaming_install_resumes_its_spine(
    hub: FakeHub, env: dict[str, str], streaming_store: Path, tmp_path: Path
) -> None:
    hub.faults.rate_bytes_s = 50_000
    exe = Path(sys.executable).with_name("deltafind")
    proc = subprocess.Popen(
        [
            str(exe),
            "setup",
            "--from",
            REPO,
            "--store",
            str(tmp_path / "s"),
            "--streaming",
            "--quiet",
        ],
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    tmp = tmp_path / "s" / "spine.safetensors.tmp"
    deadline = time.monotonic() + 120
    # the first tensors (lm_head, embeddings) are written
    while not (tmp.exists() and tmp.stat().st_size > 100_000):
        assert proc.poll() is None and time.monotonic() < deadline, (
            "setup ended before it could be killed"
        )
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    tensors = [
        r.range for r in hub.log if r.range and int(r.range[len("bytes=") :].split("-")[0]) > 8
    ]  # not headers
    first = tensors[0]  # lm_head's bytes
    hub.faults.rate_bytes_s = None
    hub.log.clear()
    _setup(env, "--from", REPO, "--store", str(tmp_path / "s"), "--streaming", "--quiet")
    assert first not in [r.range for r in hub.log]  # kept, not fetched again
    assert Manifest.load(tmp_path / "s").spine_sha256 == Manifest.load(streaming_store).spine_sha256


def test_a_failed_fetch_fails_the_request_naming_the_expert_and_url(
    hub: FakeHub, env: dict[str, str], streaming_store: Path, tmp_path: Path
) -> None:
    store = _copy(streaming_store, tmp_path)
    hub.faults.fail = {SHARDS[1], SHARDS[2]}
    hub.faults.fail_status = 403
    proc = subprocess.run(
        [sys.executable, "-c", GENERATE.format(ids=PROMPT_IDS), str(store)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )
    assert proc.returncode != 0 and not [
        line for line in proc.stdout.splitlines() if line.startswith("[")
    ]  # no tokens
    assert (
        "of layer 1 is not on disk yet" in proc.stderr
        and f"/{REPO}/resolve/{COMMIT}/model-0000" in proc.stderr
    )


def test_fill_detects_a_corrupt_range_refetches_it_and_completes_the_store(
    hub: FakeHub, env: dict[str, str], reference, streaming_store: Path, tmp_path: Path
) -> None:
    store = _copy(streaming_store, tmp_path)
    remote = json.loads((store / "remote.json").read_text())
    parts = remote["experts"][3][2]
    file, start, end = parts[0]
    hub.faults.corrupt_at[file] = (
        start + end
    ) // 2 + 1  # one byte inside that expert's first tensor
    proc = _setup(env, "--fill", "--store", str(store))
    assert file not in hub.faults.corrupt_at  # the corrupt response was served ...
    _same_store(store, reference)  # ... and the store holds the right bytes: detected and refetched
    assert (
        Manifest.load(store).source.get("remote") is None and not (store / "remote.json").exists()
    )
    assert "store complete" in proc.stdout
