"""The `deltafind` and `deltafinctl` commands as a user runs them (real subprocesses)."""

from __future__ import annotations

import json
from pathlib import Path

from deltafind.store.manifest import Manifest
from tests.conftest import deltafind_cmd


def test_demo_setup_made_a_two_drive_store(demo_store: Path) -> None:
    manifest = Manifest.load(demo_store)
    assert manifest.family == "llama" and len(manifest.drives) == 2
    assert (
        len(manifest.experts) == 30
    )  # 30 layers, each MLP one record (1.7 MB: below two 8 MiB slices, importer/plan.py)
    assert {r.drive for r in manifest.experts} == {0, 1}


def test_run_completes_the_demo_prompt_with_paris_and_stats(demo_home: Path) -> None:
    proc = deltafind_cmd(
        "run",
        "--prompt",
        "The capital of France is",
        "--max-new",
        "16",
        "--stats",
        env={"DELTAFIND_HOME": str(demo_home)},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(" Paris"), proc.stdout
    for fact in ("prefill", "decode", "tok/s", "experts requested", "read", "cache hits"):
        assert fact in proc.stderr, proc.stderr


def test_run_is_reproducible_with_a_seed(demo_store: Path) -> None:
    args = (
        "run",
        "--store",
        str(demo_store),
        "--prompt",
        "Once upon a time",
        "--max-new",
        "8",
        "--temperature",
        "0.9",
        "--seed",
        "7",
    )
    a, b = deltafind_cmd(*args), deltafind_cmd(*args)
    assert a.returncode == 0 and a.stdout == b.stdout and a.stdout.strip()


def test_run_streams_through_a_zero_cache(demo_store: Path) -> None:
    proc = deltafind_cmd(
        "run",
        "--store",
        str(demo_store),
        "--prompt",
        "The capital of France is",
        "--max-new",
        "3",
        "--expert-bytes",
        "0",
        "--stats",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(" Paris") and "cache hits 0" in proc.stderr


def test_doctor_verifies_the_demo_store(demo_store: Path) -> None:
    proc = deltafind_cmd("doctor", "--store", str(demo_store), "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert (
        "ok; 30 expert records" in proc.stdout
    )  # one slice per dense MLP: each is 1.7 MB (importer/plan.py)


def test_bench_prints_one_json_line(demo_store: Path) -> None:
    proc = deltafind_cmd("bench", "--store", str(demo_store), "--new-tokens", "4", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert (
        result["new_tokens"] == 4 and result["decode_tok_s"] > 0 and result["experts_read"] == 0
    )  # warm cache


def test_bad_config_exits_2_naming_file_key_and_value(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[cache]\nexpert_bytes = "lots"\n')
    proc = deltafind_cmd("run", "--config", str(cfg), "--prompt", "x")
    assert proc.returncode == 2
    assert str(cfg) in proc.stderr and "cache.expert_bytes" in proc.stderr and "lots" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_config_before_the_subcommand_is_used(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[server]\nport = "not a port"\n')
    for command in (["serve"], ["doctor"], ["setup", "--demo"]):
        proc = deltafind_cmd("--config", str(cfg), *command)
        assert proc.returncode == 2 and f"{cfg}: server.port" in proc.stderr, (command, proc.stderr)


def test_missing_store_is_a_clear_error(tmp_path: Path) -> None:
    proc = deltafind_cmd("run", "--store", str(tmp_path / "none"), "--prompt", "x")
    assert (
        proc.returncode == 3
        and "not a deltafind store" in proc.stderr
        and "Traceback" not in proc.stderr
    )


def test_deltafinctl_says_no_daemon(tmp_path: Path) -> None:
    import subprocess
    import sys

    exe = Path(sys.executable).with_name("deltafinctl")
    proc = subprocess.run(
        [str(exe), "--socket", str(tmp_path / "ctl.sock"), "status"], capture_output=True, text=True
    )
    assert proc.returncode == 1 and "no daemon running" in proc.stderr
