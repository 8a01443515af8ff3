"""Build and load deltafind's CPU kernels (stored_cpu.cpp, layer_cpu.cpp, mxfp4_cpu.cpp, fast_cpu.cpp) as ONE shared library.

One library, so every kernel runs on one thread pool (cpu_pool.h): two pools' idle workers would
spin against each other's work, and the layer kernels call the stored-format matmul directly.
It is compiled once per source, compiler and CPU with the system C++ compiler, cached
under ~/.cache/deltafind/kernels, called through ctypes (which drops the GIL).
`load()` returns None where no compiler works, so callers fall back to torch (`missing_note`
says so, loudly, in serve, doctor, status and --stats); a kernel never decides numerics, it
only makes them fast (except fast_cpu.cpp, the opt-in `[device] math = "bf16"`: fast_math.py).
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
from typing import Any

HERE = Path(__file__).parent
# -ffp-contract=off: a decode written as d*q + m must round twice, as the numpy oracle does.
FLAGS = [
    "-O3",
    "-march=native",
    "-std=c++17",
    "-shared",
    "-fPIC",
    "-pthread",
    "-fno-fast-math",
    "-ffp-contract=off",
]
HEADERS = (
    "cpu_pool.h",
    "stored_blocks.h",
    "stored_decode.h",
    "stored_iq.h",
    "stored_panel.h",
    "stored_q8.h",
    "stored_q8_avx2.h",
    "stored_q8_vnni512.h",
    "stored_rows.h",
)


def _cpu_tag() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
        flags = next(
            (line for line in text.splitlines() if line.startswith(("flags", "Features"))), ""
        )
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


def _compile(sources: tuple[Path, ...], out: Path, flags: list[str]) -> None:
    cxx = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++, c++ or clang++) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        proc = subprocess.run(
            [cxx, *flags, *map(str, sources), "-o", tmp],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {proc.stderr.strip()[-2000:]}")
        os.replace(tmp, out)  # atomic: a concurrent builder sees the old file or the new one
    finally:
        Path(tmp).unlink(missing_ok=True)


class KernelLibrary:
    """Kernel sources built into one library on first `load()`, then the same ctypes library (or None) every time.
    `extra_flags` follow FLAGS: the tests build the AVX2 code of an AVX-512 CPU with "-mno-avx512f"."""

    def __init__(
        self,
        sources: tuple[str, ...],
        bind: Callable[[ctypes.CDLL], ctypes.CDLL],
        extra_flags: tuple[str, ...] = (),
    ) -> None:
        self.sources, self._bind = tuple(HERE / s for s in sources), bind
        self.flags = [*FLAGS, *extra_flags]
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
            # the headers the sources include sit beside them (a bench may build another checkout's)
            folders = dict.fromkeys(p.parent for p in self.sources)
            headers = [f / h for f in folders for h in HEADERS if (f / h).is_file()]
            text = b"".join(p.read_bytes() for p in (*self.sources, *headers))
            key = hashlib.sha256(
                text + " ".join(self.flags).encode() + _cpu_tag().encode()
            ).hexdigest()[:16]
            path = kernel_dir() / f"deltafind-cpu-{key}.so"
            try:
                if not path.exists():
                    _compile(self.sources, path, self.flags)
                self._lib = self._bind(ctypes.CDLL(str(path)))
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                self.build_error = str(e)
                self._lib = None
            self._tried = True
            return self._lib


P, I64, I32, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class StoredPart(ctypes.Structure):
    """One matrix of a `df_stored_parts` call (stored_cpu.cpp's `Part`)."""

    _fields_ = [("kind", I64), ("rows", I64), ("cols", I64), ("row_bytes", I64), ("data", P)]


class AttnLayer(ctypes.Structure):
    """One attention layer's weights and shape for `df_attn_decode` (layer_cpu.cpp's `AttnLayer`);
    the optional pointers are None (NULL) where the layer has no such weight."""

    _fields_ = [
        ("qkv", P),
        ("o", P),
        ("n_qkv", I64),
        ("n_o", I64),
        ("norm", P),
        ("qkv_bias", P),
        ("o_bias", P),
        ("q_norm", P),
        ("k_norm", P),
        ("hidden", I64),
        ("hq", I64),
        ("hkv", I64),
        ("d", I64),
        ("eps", F32),
        ("qk_eps", F32),
        ("scale", F32),
    ]


class DecodeLayer(ctypes.Structure):
    """One decoder layer of a one-token step for `df_decode_layers` (layer_cpu.cpp's `DecodeLayer`)."""

    _fields_ = [
        ("attn", ctypes.POINTER(AttnLayer)),
        ("kbuf", P),
        ("vbuf", P),
        ("len", I64),
        ("gu", P),
        ("down", P),
        ("n_gu", I64),
        ("n_down", I64),
        ("norm", P),
        ("eps", F32),
        ("act", I32),
    ]


class MoeExpert(ctypes.Structure):
    """One routed expert for `df_moe_token` (layer_cpu.cpp's `MoeExpert`): its gate/up and down parts."""

    _fields_ = [("gu", P), ("down", P), ("n_gu", I64), ("n_down", I64)]


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.df_mxfp4_matmul.argtypes = [P, I64, I64, P, P, I64, I64, P, I64, I32]
    lib.df_mxfp4_matmul.restype = I32
    lib.df_mxfp4_dequant.argtypes = [P, P, I64, I64, P, I32]
    lib.df_mxfp4_dequant.restype = I32
    lib.df_mxfp4_gate_up_situ.argtypes = [P, I64, P, P, P, P, I64, I64, F32, F32, P, I32]
    lib.df_mxfp4_gate_up_situ.restype = I32
    lib.df_mxfp4_abi.restype = I32
    lib.df_stored_dequant.argtypes = [I32, P, I64, I64, P, I32]
    lib.df_stored_dequant.restype = I32
    lib.df_stored_parts.argtypes = [P, I32, I32, P, I64, I64, P, I64, I32]
    lib.df_stored_parts.restype = I32
    lib.df_stored_row_bytes.argtypes = [I32, I64]
    lib.df_stored_row_bytes.restype = I64
    lib.df_stored_abi.restype = I32
    lib.df_rms_norm.argtypes = [P, I64, I64, I64, P, F32, P]
    lib.df_rms_norm.restype = None
    lib.df_rope.argtypes = [P, I64, I64, I64, I64, P, P, P]
    lib.df_rope.restype = None
    lib.df_attend_one.argtypes = [P, P, P, I64, I64, I64, I64, I64, F32, P]
    lib.df_attend_one.restype = None
    lib.df_attn_decode.argtypes = [ctypes.POINTER(AttnLayer), P, P, P, P, P, I64, P, I32]
    lib.df_attn_decode.restype = I32
    lib.df_gated_mlp.argtypes = [P, I32, P, I32, P, I64, I32, P, F32, I32, P, I32]
    lib.df_gated_mlp.restype = I32
    lib.df_moe_token.argtypes = [P, I32, P, P, I32, P, I32]
    lib.df_moe_token.restype = I32
    lib.df_route_token.argtypes = [P, I64, I64, P, I32, I32, P, P, I32]
    lib.df_route_token.restype = I32
    lib.df_decode_layers.argtypes = [ctypes.POINTER(DecodeLayer), I32, P, P, P, I32]
    lib.df_decode_layers.restype = I32
    lib.df_layer_abi.restype = I32
    lib.df_fast_ok.restype = I32
    lib.df_fast_parts.argtypes = [P, I32, I32, P, I64, I64, P, I64, I32]
    lib.df_fast_parts.restype = I32
    lib.df_fast_mxfp4.argtypes = [P, I64, I64, P, P, I64, I64, P, I64, I32]
    lib.df_fast_mxfp4.restype = I32
    lib.df_fast_mxfp4_gate_up_situ.argtypes = [P, I64, P, P, P, P, I64, I64, F32, F32, P, I32]
    lib.df_fast_mxfp4_gate_up_situ.restype = I32
    lib.df_set_math.argtypes = [I32]
    lib.df_set_math.restype = None
    lib.df_q8_simd.restype = I32
    lib.df_q8_quantize.argtypes = [I32, P, I64, P]
    lib.df_q8_quantize.restype = I32
    return lib


SOURCES = ("stored_cpu.cpp", "layer_cpu.cpp", "mxfp4_cpu.cpp", "fast_cpu.cpp", "q8_cpu.cpp")
CPU = KernelLibrary(SOURCES, _bind)


def load_kernel() -> ctypes.CDLL | None:
    """The CPU kernel library, building it on first use; None when it cannot be built."""
    return CPU.load()


# What the torch fallback costs, measured on one K3 expert matrix (MXFP4 3072 x 3584, one Zen 4 core):
# 36x the kernel's time for one token, 3x for 64 (tests/bench/bench_kernels_peak.py has the kernels' side).
FALLBACK_COST = "every CPU matmul falls back to torch: ~36x slower decode and ~3x slower prefill per MXFP4 expert"


def kernel_status() -> dict[str, Any]:
    """Whether the CPU kernels are built, for status and --stats: built, the build error, and `missing_note`."""
    return {"built": CPU.load() is not None, "error": CPU.build_error, "note": missing_note()}


def missing_note() -> str | None:
    """None where the CPU kernels load; else the one loud sentence serve, doctor and status show: why, cost, fix."""
    if CPU.load() is not None:
        return None
    return (
        f"CPU kernels NOT built ({(CPU.build_error or '')[-500:]}); {FALLBACK_COST}. Fix: install a C++ compiler "
        "(g++ or clang++, e.g. `apt install g++`) and restart; the kernels then build once into ~/.cache/deltafind/kernels"
    )
