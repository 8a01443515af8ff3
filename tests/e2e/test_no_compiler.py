"""Without a C++ compiler the CPU kernels cannot build and every matmul runs through torch: the real
CLI must say so, with the cost and the fix, at start (the warning log), in doctor and in --stats
(which renders the status snapshot as `deltafinctl status` does)."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.conftest import deltafind_cmd


def test_without_a_compiler_doctor_run_and_stats_say_so_with_the_fix(
    demo_store: Path, tmp_path: Path
) -> None:
    # PATH holds only the venv (no g++, c++ or clang++); HOME is empty, so no kernel library is cached.
    env = {"PATH": str(Path(sys.executable).parent), "HOME": str(tmp_path)}
    doctor = deltafind_cmd("doctor", "--store", str(demo_store), "--quiet", env=env)
    assert doctor.returncode == 0, doctor.stderr
    assert (
        "CPU kernels NOT built (no C++ compiler" in doctor.stderr
        and "apt install g++" in doctor.stderr
    ), doctor.stderr
    run = deltafind_cmd(
        "run",
        "--store",
        str(demo_store),
        "--prompt",
        "The capital of France is",
        "--max-new",
        "2",
        "--stats",
        env=env,
    )
    assert run.returncode == 0, run.stderr
    assert "cpu_kernels_missing" in run.stderr and "slower decode" in run.stderr, (
        run.stderr
    )  # the start-up warning
    assert "[stats] kernels    CPU kernels NOT built" in run.stderr, run.stderr
    assert not list(
        (tmp_path / ".cache" / "deltafind" / "kernels").glob("*.so")
    )  # nothing was built behind its back
