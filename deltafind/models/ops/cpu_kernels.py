"""Build and load deltafind's CPU kernels (mxfp4_cpu.cpp, stored_cpu.cpp, layer_cpu.cpp) as plain shared libraries.

Each is compiled once per source, compiler and CPU with the system C++ compiler, cached
under ~/.cache/deltafind/kernels, called through ctypes (which drops the GIL).
`load()` returns None where no compiler works, so callers fall back to torch; a kernel
never decides numerics, it only makes them fast.
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
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).parent
# -ffp-contract=off: a decode written as d*q + m must round twice, as the numpy oracle does.
FLAGS = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-pthread", "-fno-fast-math", "-ffp-contract=off"]
HEADERS = ("cpu_pool.h", "stored_blocks.h")


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


def _compile(source: Path, out: Path) -> None:
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++, c++ or clang++) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        proc = subprocess.run([cxx, *FLAGS, str(source), "-o", tmp], capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, out)  # atomic: a concurrent builder sees the old file or the new one
    finally:
        Path(tmp).unlink(missing_ok=True)


class KernelLibrary:
    """One kernel source: built on first `load()`, then the same ctypes library (or None) every time."""

    def __init__(self, source: str, bind: Callable[[ctypes.CDLL], ctypes.CDLL]) -> None:
        self.source, self._bind = HERE / source, bind
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._tried = False
        self.build_error: str | None = None  # why the kernel is unavailable, for logs and benches

    def load(self) -> ctypes.CDLL | None:
        if self._tried:
            return self._lib
        with self._lock:
            if self._tried:
                return self._lib
            text = self.source.read_bytes() + b"".join((HERE / h).read_bytes() for h in HEADERS)
            key = hashlib.sha256(text + " ".join(FLAGS).encode() + _cpu_tag().encode()).hexdigest()[:16]
            path = kernel_dir() / f"{self.source.stem}-{key}.so"
            try:
                if not path.exists():
                    _compile(self.source, path)
                self._lib = self._bind(ctypes.CDLL(str(path)))
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                self.build_error = str(e)
                self._lib = None
            self._tried = True
            return self._lib


P, I64, I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


def _bind_mxfp4(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.df_mxfp4_matmul.argtypes = [P, I64, I64, P, P, I64, I64, P, I64, I32]
    lib.df_mxfp4_matmul.restype = I32
    lib.df_mxfp4_dequant.argtypes = [P, P, I64, I64, P, I32]
    lib.df_mxfp4_dequant.restype = I32
    lib.df_mxfp4_gate_up_situ.argtypes = [P, I64, P, P, P, P, I64, I64, ctypes.c_float, ctypes.c_float, P, I32]
    lib.df_mxfp4_gate_up_situ.restype = I32
    lib.df_mxfp4_abi.restype = I32
    return lib


class StoredPart(ctypes.Structure):
    """One matrix of a `df_stored_parts` call (stored_cpu.cpp's `Part`)."""

    _fields_ = [("kind", I64), ("rows", I64), ("cols", I64), ("row_bytes", I64), ("data", P)]


def _bind_stored(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.df_stored_dequant.argtypes = [I32, P, I64, I64, P, I32]
    lib.df_stored_dequant.restype = I32
    lib.df_stored_parts.argtypes = [P, I32, I32, P, I64, I64, P, I64, I32]
    lib.df_stored_parts.restype = I32
    lib.df_stored_row_bytes.argtypes = [I32, I64]
    lib.df_stored_row_bytes.restype = I64
    lib.df_stored_abi.restype = I32
    return lib


def _bind_layer(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.df_rms_norm.argtypes = [P, I64, I64, I64, P, ctypes.c_float, P]
    lib.df_rms_norm.restype = None
    lib.df_rope.argtypes = [P, I64, I64, I64, I64, P, P, P]
    lib.df_rope.restype = None
    lib.df_attend_one.argtypes = [P, P, P, I64, I64, I64, I64, I64, ctypes.c_float, P]
    lib.df_attend_one.restype = None
    lib.df_layer_abi.restype = I32
    return lib


MXFP4 = KernelLibrary("mxfp4_cpu.cpp", _bind_mxfp4)
STORED = KernelLibrary("stored_cpu.cpp", _bind_stored)
LAYER = KernelLibrary("layer_cpu.cpp", _bind_layer)


def load_kernel() -> ctypes.CDLL | None:
    """The MXFP4 kernel library, building it on first use; None when it cannot be built."""
    return MXFP4.load()
