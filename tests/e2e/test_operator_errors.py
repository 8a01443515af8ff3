"""The operator's side: file modes, permission messages, doctor, install-service, `run --chat` at a terminal."""

from __future__ import annotations

import json
import os
import pty
import select
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deltafind.daemon.service import hidden_paths, render_unit
from tests.conftest import deltafind_cmd

BIN = Path(sys.executable).parent


def _setup(store: Path, *drives: Path, umask: int = 0o022) -> subprocess.CompletedProcess[str]:
    args = ["setup", "--synthetic", "llama", "--shape", "tiny", "--store", str(store), "--quiet"]
    for d in drives:
        args += ["--drive", str(d)]
    return subprocess.run(
        [str(BIN / "deltafind"), *args],
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=lambda: os.umask(umask),
    )


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_store_files_honour_the_umask(tmp_path: Path, umask: int) -> None:
    proc = _setup(tmp_path / "store", umask=umask)
    assert proc.returncode == 0, proc.stderr
    for name in ("manifest.json", "spine.safetensors", "config.json"):
        assert stat.S_IMODE((tmp_path / "store" / name).stat().st_mode) == 0o666 & ~umask, name


def _capless(*args: str) -> subprocess.CompletedProcess[str]:
    """As root without the capabilities that bypass file permissions: what a service user meets."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to drop CAP_DAC_OVERRIDE")
    return subprocess.run(
        ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_store_the_user_cannot_read_names_path_and_permission_not_setup(tmp_path: Path) -> None:
    store = tmp_path / "store"
    assert _setup(store).returncode == 0
    os.chmod(tmp_path, 0o755)
    manifest = store / "manifest.json"
    os.chown(manifest, 65534, -1)  # someone else's, 0600: as setup wrote it before this fix
    os.chmod(manifest, 0o600)
    for cmd in (
        ["doctor", "--store", str(store)],
        [
            "serve",
            "--store",
            str(store),
            "--server-port",
            "0",
            "--socket",
            str(tmp_path / "c.sock"),
        ],
    ):
        proc = _capless(str(BIN / "deltafind"), *cmd)
        assert proc.returncode == 3, proc.stderr
        assert (
            f"{manifest}: permission denied" in proc.stderr and "no read permission" in proc.stderr
        ), proc.stderr
        assert "setup" not in proc.stderr and "Traceback" not in proc.stderr
    os.chmod(store, 0o700)
    os.chown(store, 65534, -1)
    proc = _capless(str(BIN / "deltafind"), "doctor", "--store", str(store))
    assert (
        proc.returncode == 3
        and "no search (x) permission" in proc.stderr
        and str(store) in proc.stderr
    ), proc.stderr


def test_doctor_reports_every_missing_drive(tmp_path: Path) -> None:
    d0, d1 = tmp_path / "nvme0", tmp_path / "nvme1"
    assert _setup(tmp_path / "store", d0, d1).returncode == 0
    shutil.rmtree(d0)
    shutil.rmtree(d1)
    proc = deltafind_cmd("doctor", "--store", str(tmp_path / "store"), "--quiet")
    assert proc.returncode == 4
    assert (
        f"drive 0 ({d0}) is missing" in proc.stderr and f"drive 1 ({d1}) is missing" in proc.stderr
    ), proc.stderr


def test_install_service_warns_when_the_sandbox_hides_store_or_config(tmp_path: Path) -> None:
    cfg = tmp_path / "deltafind.toml"  # pytest's tmp_path lies under /tmp: PrivateTmp=yes hides it
    cfg.write_text('[model]\nstore = "/home/someone/store"\n')
    warnings = hidden_paths(render_unit(cfg), cfg)
    assert any("ProtectHome=yes" in w and "/home/someone/store" in w for w in warnings), warnings
    assert any("PrivateTmp=yes" in w and str(tmp_path) in w for w in warnings), warnings
    assert hidden_paths(render_unit(cfg, user=True), cfg) == [
        w for w in warnings if "PrivateTmp" in w
    ]
    proc = subprocess.run(
        [
            str(BIN / "deltafind"),
            "install-service",
            "--config",
            str(cfg),
            "--print",
            "--platform",
            "linux",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and "warning: ProtectHome=yes hides /home" in proc.stderr, (
        proc.stderr
    )


def _read_until(fd: int, needle: bytes, out: bytearray, since: int = 0, timeout: float = 60) -> int:
    """Read until `needle` shows up after offset `since`; the offset just past it."""
    deadline = time.monotonic() + timeout
    while needle not in out[since:]:
        left = deadline - time.monotonic()
        assert left > 0, f"no {needle!r} in {bytes(out)[-400:]!r}"
        if select.select([fd], [], [], left)[0]:
            try:
                out += os.read(fd, 4096)
            except OSError:
                break
    return out.index(needle, since) + len(needle)


def test_run_chat_has_history_and_ctrl_c_stops_only_the_reply(
    demo_store: Path, tmp_path: Path
) -> None:
    pid, fd = pty.fork()
    if pid == 0:  # the child: a user at a terminal
        os.environ.update(DELTAFIND_HOME=str(tmp_path), OMP_NUM_THREADS="1", TERM="xterm")
        # A shell starts a command with SIGINT at its default and unblocked; a fork of this test process
        # inherits whatever an earlier test's libraries left (an exec keeps ignored and blocked signals).
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.execv(
            str(BIN / "deltafind"),
            [
                str(BIN / "deltafind"),
                "run",
                "--chat",
                "--store",
                str(demo_store),
                "--max-new",
                "400",
            ],
        )
    out = bytearray()
    try:
        at = _read_until(fd, b"> ", out, timeout=120)
        for turn in range(2):
            start = at
            os.write(
                fd, b"Count from 1 to 300, one number per line.\r" if turn == 0 else b"\x1b[A\r"
            )  # then Up: the same line
            at = _read_until(fd, b"\n", out, at)
            at = _read_until(fd, b"1", out, at)  # the reply has started
            os.write(fd, b"\x03")  # Ctrl-C
            at = _read_until(fd, b"[stopped]", out, at)
            at = _read_until(fd, b"> ", out, at)
            assert b"Count from 1 to 300" in out[start:], bytes(out[start:])
        os.write(fd, b"\x04")  # Ctrl-D at the prompt ends the chat
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0, bytes(out)
    assert b"^[[A" not in out and b"interrupted" not in out
    assert "Count from 1 to 300" in (tmp_path / "chat_history").read_text()


@pytest.mark.parametrize("closed", ["drive", "parent"])
def test_doctor_says_permission_for_a_drive_folder_it_cannot_search(
    tmp_path: Path, closed: str
) -> None:
    drive = tmp_path / "mnt" / "nvme0"
    assert _setup(tmp_path / "store", drive).returncode == 0
    os.chmod(tmp_path, 0o755)
    shut = drive if closed == "drive" else drive.parent
    os.chown(shut, 65534, -1)
    os.chmod(shut, 0o700)
    proc = _capless(str(BIN / "deltafind"), "doctor", "--store", str(tmp_path / "store"), "--quiet")
    assert proc.returncode == 4, proc.stderr
    assert (
        f"drive 0 ({drive}): {shut}: permission denied" in proc.stderr
        and "no search (x) permission" in proc.stderr
    ), proc.stderr
    assert "missing" not in proc.stderr


def test_setup_on_a_full_disk_names_the_path_and_the_fix(tmp_path: Path) -> None:
    disk = tmp_path / "small"
    disk.mkdir()
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)],
        capture_output=True,
        text=True,
    )
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mount.stderr.strip()}")
    try:
        proc = _setup(disk / "store")
        assert proc.returncode == 3, proc.stderr
        assert f"{disk / 'store'}" in proc.stderr and "No space left on device" in proc.stderr, (
            proc.stderr
        )
        assert "run the same setup again" in proc.stderr and "Traceback" not in proc.stderr, (
            proc.stderr
        )
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_a_second_setup_into_the_same_store_is_refused_naming_the_first(tmp_path: Path) -> None:
    store = tmp_path / "store"
    args = [
        str(BIN / "deltafind"),
        "setup",
        "--synthetic",
        "qwen3_moe",
        "--shape",
        "tiny",
        "--store",
        str(store),
        "--quiet",
    ]
    first = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    # stop it mid-import (its journal begun)
    while time.monotonic() < deadline and first.poll() is None:
        if (store / "setup.journal").exists() and not (store / "manifest.json").exists():
            os.kill(first.pid, signal.SIGSTOP)
            break
        time.sleep(0.002)
    else:
        first.wait()
        pytest.skip("the first setup finished before it could be caught holding the lock")
    try:
        second = subprocess.run(args, capture_output=True, text=True, timeout=120)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert second.returncode == 3 and f"another setup (pid {first.pid})" in second.stderr, (
        second.stderr
    )
    assert "Traceback" not in second.stderr
    _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert deltafind_cmd("doctor", "--store", str(store), "--quiet").returncode == 0


def test_a_truncated_pack_marks_its_drive_unhealthy_and_health_degraded(tmp_path: Path) -> None:
    from tests.e2e.daemon_fixtures import Daemon

    store = tmp_path / "store"
    proc = subprocess.run(
        [
            str(BIN / "deltafind"),
            "setup",
            "--synthetic",
            "qwen3_moe",
            "--shape",
            "tiny",
            "--store",
            str(store),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    pack = store / "drive0" / "experts-0.pack"
    os.truncate(
        pack, pack.stat().st_size - 4096
    )  # the last record (layer 1, expert 7) loses its tail
    d = Daemon(store)
    try:
        d.start(timeout=180)
        status, body = d.get("/health")
        health = json.loads(body)
        assert status == 200 and health["status"] == "degraded", health
        assert str(pack) in health["drives"][0] and "truncated" in health["drives"][0], health
        metrics = d.get("/metrics")[1].decode()
        assert 'deltafind_drive_healthy{drive="0"} 0' in metrics, [
            ln for ln in metrics.splitlines() if "healthy" in ln
        ]
        assert "pack_truncated" in d.log_text(full=True)
    finally:
        assert d.stop() == 0
        d.cleanup()
