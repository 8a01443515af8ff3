"""The spine in memory: what stays resident, and prefix residency when it does not fit.

`[cache] spine_bytes` bounds the spine's memory (in its in-memory dtypes, on the
compute device). Always resident: every tensor outside `model.layers.N.`
(embeddings, final norm, head, K3's output mixture) and, in every layer, its
router and its 1-D tensors (norms, biases) — next-layer prefetch applies layer
i+1's norm and router before that layer is streamed in, and they are tiny.
The largest prefix of layers that fits stays resident too; the rest is read
layer by layer from spine.safetensors while the previous layer computes, at
most two streamed layers held at once (both counted in the budget).
Knows tensor names and the safetensors layout, not model families. Device-
agnostic: tensors land on the given device.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import json
import os
import re
import resource
import threading
import time
from collections.abc import Callable, Collection, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from deltafind.errors import StoreError
from deltafind.log import get_logger
from deltafind.store.quant import SPINE_METADATA_KEY

log = get_logger(__name__)
LAYER = re.compile(r"^model\.layers\.(\d+)\.")
ROUTER = re.compile(r"\.(?:mlp|block_sparse_moe)\.gate\.(?:weight|e_score_correction_bias)$")
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
HELD_LAYERS = 2  # the streamed layer computing plus the one being read


@dataclass(frozen=True)
class SpineTensor:
    name: str
    dtype: torch.dtype  # as stored
    shape: tuple[int, ...]
    offset: int  # absolute, in spine.safetensors
    nbytes: int  # as stored
    target: torch.dtype  # in memory
    quant: str = ""  # GGUF blocks kept as stored (store/quant.py): uint8 [rows, row_bytes]

    @property
    def resident_bytes(self) -> int:
        return self.nbytes // self.dtype.itemsize * self.target.itemsize


def target_dtype(
    name: str, stored: torch.dtype, compute: torch.dtype, keep: bool = False
) -> torch.dtype:
    """The in-memory dtype: floats take the compute dtype, except routing biases, which stay fp32
    (as in HF: rounding them can flip expert choices), and `keep` tensors (matmul weights the model
    computes on as stored, models/ops/stored.py), which stay bf16/fp16; integers stay as stored."""
    if not stored.is_floating_point or name.endswith("e_score_correction_bias"):
        return stored
    if keep and stored in (torch.bfloat16, torch.float16):
        return stored
    return compute


def read_layout(path: Path, compute: torch.dtype, keep: Collection[str] = ()) -> list[SpineTensor]:
    """Tensors of a safetensors file with their absolute offsets (header only, no data); the names in
    `keep` stay in their stored half-precision dtype in memory."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        raise StoreError(
            f"{path}: unreadable spine header ({e}); run `deltafind doctor` and re-import the store"
        ) from e
    try:
        quants = json.loads(header.get("__metadata__", {}).get(SPINE_METADATA_KEY, "{}"))
    except ValueError as e:
        raise StoreError(
            f"{path}: unreadable {SPINE_METADATA_KEY} metadata ({e}); re-import the store"
        ) from e
    out = []
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        start, end = meta["data_offsets"]
        dtype = SAFETENSORS_DTYPES[meta["dtype"]]
        out.append(
            SpineTensor(
                name,
                dtype,
                tuple(meta["shape"]),
                8 + n + start,
                end - start,
                target_dtype(name, dtype, compute, name in keep),
                quants.get(name, ""),
            )
        )
    return out


@dataclass
class SpinePlan:
    """Which layers stay resident and what a budget costs, all in bytes."""

    always: list[SpineTensor]
    layers: dict[int, list[SpineTensor]]  # streamable tensors of each layer
    resident_layers: int  # layers [0, resident_layers) stay resident
    num_layers: int
    window_bytes: int  # room for the streamed layers held at once

    @property
    def streamed(self) -> list[int]:
        return [i for i in range(self.resident_layers, self.num_layers) if self.layers.get(i)]

    @property
    def resident_bytes(self) -> int:
        return sum(t.resident_bytes for t in self.resident_tensors())

    def resident_tensors(self) -> list[SpineTensor]:
        prefix = (t for i in range(self.resident_layers) for t in self.layers.get(i, []))
        return [*self.always, *prefix]


def plan_spine(
    tensors: Iterable[SpineTensor], num_layers: int, budget_bytes: int | None
) -> SpinePlan:
    """Keep the largest prefix of layers resident within `budget_bytes` (None: everything)."""
    always: list[SpineTensor] = []
    layers: dict[int, list[SpineTensor]] = {}
    for t in tensors:
        m = LAYER.match(t.name)
        # outside the layers, a layer's 1-D tensors and its router (the module docstring says why)
        if m is None or len(t.shape) <= 1 or ROUTER.search(t.name) or int(m[1]) >= num_layers:
            always.append(t)
        else:
            layers.setdefault(int(m[1]), []).append(t)
    sizes = [sum(t.resident_bytes for t in layers.get(i, [])) for i in range(num_layers)]
    base = sum(t.resident_bytes for t in always)
    if budget_bytes is None or base + sum(sizes) <= budget_bytes:
        return SpinePlan(always, layers, num_layers, num_layers, 0)
    for prefix in range(num_layers - 1, -1, -1):
        rest = sizes[prefix:]
        window = min(HELD_LAYERS, sum(1 for s in rest if s)) * max(rest)
        if base + sum(sizes[:prefix]) + window <= budget_bytes:
            return SpinePlan(always, layers, prefix, num_layers, window)
    window = min(HELD_LAYERS, sum(1 for s in sizes if s)) * max(sizes)
    raise StoreError(
        f"[cache] spine_bytes = {budget_bytes} is below the minimum of {base + window} bytes for this store: "
        f"{base} always resident (embeddings, head, final norm, routers, norms) + {window} for two streamed layers; "
        "raise it, or unset it to keep the whole spine resident"
    )


class SpineStreamer:
    """Installs streamed layers' tensors into the model just before they compute.

    `enter(i)` is called by the model at the top of layer i: it drops streamed
    layers no longer needed, waits for layer i's tensors (already being read
    since the previous layer began) and starts reading the next streamed layer.
    Reads run on one background thread, so they overlap with compute.
    """

    def __init__(self, path: Path, plan: SpinePlan, device: str | torch.device = "cpu") -> None:
        self.path, self.plan, self.device = Path(path), plan, torch.device(device)
        self.streamed = plan.streamed
        self._next = {
            i: self.streamed[(k + 1) % len(self.streamed)] for k, i in enumerate(self.streamed)
        }
        self._slots: dict[
            str, tuple[nn.Module, str, torch.Tensor]
        ] = {}  # name -> (module, leaf, placeholder)
        self._held: dict[int, Future[dict[str, torch.Tensor]]] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spine")
        self._fd = os.open(self.path, os.O_RDONLY)
        self.layers_read = 0
        self.bytes_read = 0
        self.wait_s = 0.0

    def bind(self, net: nn.Module) -> None:
        """Remember where each streamed tensor goes (its module is still on the meta device)."""
        for i in self.streamed:
            for t in self.plan.layers[i]:
                module_name, _, leaf = t.name.rpartition(".")
                module = net.get_submodule(module_name)
                self._slots[t.name] = (module, leaf, getattr(module, leaf))

    def enter(self, layer_idx: int) -> None:
        """Make layer `layer_idx` runnable; start reading the streamed layer after it."""
        nxt = self._following(layer_idx)
        for j in [j for j in self._held if j not in (layer_idx, nxt)]:
            self._uninstall(j)
        if layer_idx in self._next:
            fut = self._held.get(layer_idx) or self._start(layer_idx)
            t0 = time.perf_counter()
            try:
                tensors = fut.result()
            except BaseException:
                self._held.pop(layer_idx, None)  # the next step reads it again
                raise  # fails the request that needed this layer; the engine keeps serving
            finally:
                self.wait_s += time.perf_counter() - t0
            for name, t in tensors.items():
                module, leaf, placeholder = self._slots[
                    name
                ]  # nn.Module.__setattr__ registers a parameter or a buffer
                setattr(
                    module,
                    leaf,
                    nn.Parameter(t, requires_grad=False)
                    if isinstance(placeholder, nn.Parameter)
                    else t,
                )
        if nxt is not None and nxt not in self._held:
            self._start(nxt)

    def _following(self, layer_idx: int) -> int | None:
        if not self.streamed:
            return None
        if layer_idx in self._next:
            return self._next[layer_idx]
        return next((i for i in self.streamed if i > layer_idx), self.streamed[0])

    def _start(self, layer_idx: int) -> Future[dict[str, torch.Tensor]]:
        fut = self._pool.submit(self._read_layer, layer_idx)
        self._held[layer_idx] = fut
        return fut

    def _uninstall(self, layer_idx: int) -> None:
        fut = self._held.pop(layer_idx)
        if not fut.cancel():
            fut.exception()  # wait for a running read; its error (if any) already reached a request via enter
        for t in self.plan.layers[layer_idx]:
            module, leaf, placeholder = self._slots[t.name]
            setattr(module, leaf, placeholder)

    def _read_layer(self, layer_idx: int) -> dict[str, torch.Tensor]:
        out = {}
        for t in self.plan.layers[layer_idx]:
            raw = torch.empty(t.nbytes, dtype=torch.uint8)
            n = os.preadv(self._fd, [raw.numpy()], t.offset)  # straight into the tensor's storage
            if n != t.nbytes:
                raise StoreError(
                    f"{self.path}: short read of {t.name} ({n} of {t.nbytes} bytes); the spine is truncated — run `deltafind doctor`"
                )
            stored = (
                raw.view(t.dtype).view(t.shape) if t.nbytes else torch.empty(t.shape, dtype=t.dtype)
            )
            out[t.name] = stored.to(device=self.device, dtype=t.target)
            self.bytes_read += t.nbytes
        # streaming exists because RAM is short: do not keep a page-cache copy
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)
        self.layers_read += 1
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


@dataclass
class MemoryLock:
    """mlock for resident host tensors where RLIMIT_MEMLOCK (or CAP_IPC_LOCK) allows; logged once when not."""

    locked: list[tuple[int, int]] = field(default_factory=list)
    locked_bytes: int = 0
    refused: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def lock(self, tensors: Iterable[torch.Tensor], what: str = "spine") -> int:
        libc = _libc()
        tensors = [t for t in tensors if t.device.type == "cpu" and t.numel()]
        # each storage once: tensors moved to huge pages share one (store/huge_pages.py)
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        want = sum(storages.values())
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        if libc is None:
            return self._refuse(what, want, soft, "no libc mlock on this platform")
        if os.geteuid() != 0 and soft != resource.RLIM_INFINITY and want > soft:
            return self._refuse(what, want, soft, "RLIMIT_MEMLOCK is below the resident size")
        for ptr, n in storages.items():
            if libc.mlock(ctypes.c_void_p(ptr), ctypes.c_size_t(n)) != 0:
                err = ctypes.get_errno()
                return self._refuse(what, want, soft, os.strerror(err) if err else "mlock failed")
            self.locked.append((ptr, n))
            self.locked_bytes += n
        log.info("memory_locked", what=what, bytes=self.locked_bytes)
        return self.locked_bytes

    def _refuse(self, what: str, want: int, soft: int, why: str) -> int:
        if not self.refused:
            self.refused = True
            limit = "unlimited" if soft == resource.RLIM_INFINITY else soft
            log.warning(
                "mlock_unavailable",
                what=what,
                bytes=want,
                rlimit_memlock=limit,
                reason=why,
                fix="raise LimitMEMLOCK= in the service unit (or `ulimit -l`); the spine may be paged out under pressure",
            )
        return self.locked_bytes

    def unlock(self) -> None:
        libc = _libc()
        with self._lock:
            for ptr, n in self.locked:
                if libc is not None:
                    libc.munlock(ctypes.c_void_p(ptr), ctypes.c_size_t(n))
            self.locked.clear()
            self.locked_bytes = 0


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name, use_errno=True) if name else None
    except OSError:
        return None
    return lib if lib is not None and hasattr(lib, "mlock") else None


def load_resident(
    path: Path, plan: SpinePlan, device: str | torch.device, load: Callable[[str], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The resident tensors, each converted to its in-memory dtype on `device`."""
    tensors = sorted(plan.resident_tensors(), key=lambda t: t.name)
    return {t.name: load(t.name).to(device=device, dtype=t.target) for t in tensors}
