"""Build and load the MXFP4 CPU kernel (mxfp4_cpu.cpp) as a plain shared library.

Compiled once per source, compiler and CPU with the system C++ compiler, cached
under ~/.cache/deltafind/kernels, called through ctypes (which drops the GIL).
Returns None where no compiler works, so callers fall back to torch; it never
decides numerics, it only makes them fast.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

SOURCE = Path(__file__).with_name("mxfp4_cpu.cpp")
FLAGS = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-pthread", "-fno-fast-math"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
build_error: str | None = None  # why the kernel is unavailable, for logs and the bench


def _cpu_tag() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
        flags = next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")
        model = next((line for line in text.splitlines() if line.startswith("model name")), "")
        return model + flags
    except OSError:
        return platform.processor()


def kernel_dir() -> Path:
    base = Path.home() / ".cache" / "deltafind" / "kernels"
    try:
        base.mkdir(parents=True, exist_ok=True)
        return base
    except OSError:
        return Path(tempfile.gettempdir()) / "deltafind-kernels"


def _compile(out: Path) -> None:
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++, c++ or clang++) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        proc = subprocess.run([cxx, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, out)  # atomic: a concurrent builder sees the old file or the new one
    finally:
        Path(tmp).unlink(missing_ok=True)


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.df_mxfp4_matmul.argtypes = [p, i64, i64, p, p, i64, i64, p, i64, i32]
    lib.df_mxfp4_matmul.restype = i32
    lib.df_mxfp4_dequant.argtypes = [p, p, i64, i64, p, i32]
    lib.df_mxfp4_dequant.restype = i32
    lib.df_mxfp4_gate_up_situ.argtypes = [p, i64, p, p, p, p, i64, i64, ctypes.c_float, ctypes.c_float, p, i32]
    lib.df_mxfp4_gate_up_situ.restype = i32
    lib.df_mxfp4_abi.restype = i32
    return lib


def load_kernel() -> ctypes.CDLL | None:
    """The compiled kernel library, building it on first use; None when it cannot be built."""
    global _lib, _tried, build_error
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + _cpu_tag().encode()).hexdigest()[:16]
        path = kernel_dir() / f"mxfp4_cpu-{key}.so"
        try:
            if not path.exists():
                _compile(path)
            _lib = _bind(ctypes.CDLL(str(path)))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            build_error = str(e)
            _lib = None
        _tried = True
        return _lib
