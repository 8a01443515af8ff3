"""The process groups of a cluster and the per-layer messages over them (torch.distributed point-to-point).

Rank 0 is the coordinator, ranks 1..N the expert nodes. They meet at a torch.distributed store on
the coordinator (its own TCPStore, or torchrun's agent store when torchrun started it); each node
announces itself there (a counter per rank: its generation) and forms a gloo group of two with the
coordinator for that generation. A group per pair means a stalled node cannot close the others'
connections (a timed-out gloo wait closes its group), and a restarted node joins with a new
generation while the others keep serving. A message is two gloo sends: a fixed int64 header ending in
the byte count of its body, then the body, every tensor of the message packed into one byte tensor
(each on an 8-byte boundary). Two sends, not one per tensor: the coordinator makes them for every
node and layer, one after another. No socket protocol of our own sits on the hot path.
Knows tensors and ranks, never models or stores.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from deltafind.config import ClusterSettings
from deltafind.errors import ConfigError, DeltafindError

# The message layout below. Every side writes its own into the store when it meets the others, and a
# node and coordinator of different layouts refuse each other with a message (gloo would only see a
# size mismatch, which read as a lost connection). An older node writes none: layout 1.
PROTOCOL = 2
OP_RUN, OP_PREFETCH, OP_STOP, OP_PLACEMENT = 1, 2, 3, 4
# request: op, layer, experts, rows, dim, dtype, predicted layer, predicted experts (-1: the previous route);
# body: the expert ids, their row counts and the predicted ids (int64), the row indices (int64), the rows
REQUEST = 8
# reply: status (0 ok, 1 error), error bytes, out dtype, bytes read, experts read, cache hits, read wait us, read kB/s;
# body: the outputs, one expert's rows after another (or the error's text)
REPLY = 8
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8)
FOREVER = timedelta(
    days=365
)  # a node waits this long for the next request (a wait without one would use the group's)
DEFAULT_PORT = 29500
Pair = Any  # a gloo group of the coordinator (its rank 0) and one node (its rank 1)


class ClusterError(DeltafindError):
    """An expert node is down, timed out or failed a layer; the requests in flight fail with this."""


@dataclass(frozen=True)
class GroupSpec:
    rank: int
    world_size: int
    address: str
    port: int
    backend: str
    join_timeout_s: float
    timeout_s: float


def group_spec(cluster: ClusterSettings) -> GroupSpec:
    """`[cluster]` (and $RANK/$WORLD_SIZE/$MASTER_ADDR/$MASTER_PORT, merged by the config) as a checked spec."""
    if cluster.world_size is None:
        raise ConfigError(
            "[cluster] world_size is unset (and $WORLD_SIZE too): set it to 1 + the number of expert nodes"
        )
    rank = cluster.rank if cluster.rank is not None else 0
    if cluster.role == "coordinator" and rank != 0:
        raise ConfigError(
            f"[cluster] role = \"coordinator\" needs rank 0, not {rank}: the expert nodes are ranks 1..{cluster.world_size - 1}"
        )
    if cluster.role == "expert" and not 1 <= rank < cluster.world_size:
        raise ConfigError(
            f"[cluster] role = \"expert\" needs a rank from 1 to {cluster.world_size - 1} (world_size - 1), not {rank}"
        )
    # device tensors on the wire need a machine with a GPU per rank to test them
    if cluster.backend == "nccl":
        raise ConfigError(
            "[cluster] backend = \"nccl\" is refused: the exchange moves CPU tensors over gloo, and NCCL "
            "has never run on GPUs here, so it is not offered until it has; set backend = \"gloo\" (or auto)"
        )
    return GroupSpec(
        rank,
        cluster.world_size,
        cluster.coordinator or "127.0.0.1",
        cluster.port or DEFAULT_PORT,
        "gloo",  # auto, and gloo: the one backend offered (nccl refused above)
        cluster.join_timeout_s,
        cluster.timeout_s,
    )


def meet(spec: GroupSpec) -> dist.Store:
    """The store where the cluster meets: the coordinator serves it, unless torchrun started the coordinator
    (its agent already serves one at MASTER_ADDR:MASTER_PORT). Keys are our own, unprefixed, so a node
    restarted without torchrun (systemd, by hand) finds the same store and rejoins."""
    where = f"{spec.address}:{spec.port}"
    serve = spec.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    try:
        return dist.TCPStore(
            spec.address,
            spec.port,
            None,
            serve,
            timedelta(seconds=spec.join_timeout_s),
            wait_for_workers=False,
        )
    except (RuntimeError, ValueError, OSError) as e:
        raise ClusterError(
            f"rank {spec.rank} of {spec.world_size}: the cluster's store at {where} "
            f"{'could not listen' if serve else 'did not answer within [cluster] join_timeout_s'} ({e}); "
            "check [cluster] coordinator/port (or MASTER_ADDR/MASTER_PORT), that the coordinator runs, "
            "and the firewall"
        ) from None


def announce(store: dist.Store, rank: int, wait_s: float) -> int:
    """A node says it is (re)starting, with its message layout; returns its generation (1 for its first
    start). Refused, with a message, when the coordinator (awaited up to wait_s) speaks another layout."""
    store.set(f"deltafind/protocol{rank}", str(PROTOCOL))
    check_protocol(store, 0, rank, wait_s)
    return int(store.add(f"deltafind/node{rank}", 1))


def check_protocol(store: dist.Store, peer: int, me: int, wait_s: float = 0.0) -> None:
    """Raise ClusterError unless rank `peer` announced this deltafind's message layout (0: the coordinator),
    waiting up to wait_s for it to announce one."""
    key = f"deltafind/protocol{peer}"
    if wait_s > 0:
        try:
            store.wait([key], timedelta(seconds=wait_s))
        except RuntimeError:
            raise ClusterError(
                f"rank {me}: the coordinator did not announce its message layout within [cluster] "
                "join_timeout_s: it is not running, or runs an older deltafind (run the same version "
                "on every machine)"
            ) from None
    theirs = int(store.get(key)) if store.check([key]) else 1
    if theirs != PROTOCOL:
        who = "the coordinator" if peer == 0 else f"expert node {peer}"
        raise ClusterError(
            f"rank {me}: {who} speaks cluster message layout {theirs} and this deltafind speaks {PROTOCOL}; "
            "run the same deltafind version on every machine"
        )


def generation(store: dist.Store, rank: int, deadline: float | None = None) -> int:
    """Node `rank`'s latest generation (0: never announced), waiting until `deadline` for its first."""
    key = f"deltafind/node{rank}"
    if deadline is not None:
        try:
            store.wait([key], timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        except RuntimeError:
            raise ClusterError(
                f"expert node {rank} did not join within [cluster] join_timeout_s; start it "
                "(`deltafind node`) with the coordinator's address and port"
            ) from None
    return int(store.add(key, 0))


def pair(store: dist.Store, spec: GroupSpec, node: int, gen: int) -> Pair:
    """The gloo group of the coordinator and node `node`'s generation `gen` (blocks until both sides form it)."""
    try:
        return dist.ProcessGroupGloo(
            dist.PrefixStore(f"deltafind/pair{node}/{gen}", store),
            1 if spec.rank else 0,
            2,
            timedelta(seconds=spec.join_timeout_s),
        )
    except (RuntimeError, ValueError, OSError) as e:
        raise ClusterError(
            f"rank {spec.rank}: no connection with {'the coordinator' if spec.rank else f'node {node}'} "
            f"({e}); check the firewall between the machines"
        ) from None


def dtype_code(dtype: torch.dtype) -> int:
    return DTYPES.index(dtype)


def send(link: Pair, header: list[int], *tensors: torch.Tensor) -> list[Any]:
    """Start sending a header and its tensors (as one body) to the other side of `link`; the caller waits the works."""
    peer = 1 - link.rank()
    body = pack(tensors)
    works = [link.send([torch.tensor([*header, body.numel()], dtype=torch.int64)], peer, 0)]
    if body.numel():
        works.append(link.send([body], peer, 0))
    return works


def sent_bytes(header: list[int], *tensors: torch.Tensor) -> int:
    """What `send` puts on the wire for this message (header with its byte count, the padded body)."""
    return 8 * (len(header) + 1) + sum(_padded(t.numel() * t.element_size()) for t in tensors)


def pack(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The tensors' bytes in order, each starting on an 8-byte boundary (so `Body.take` views them in place)."""
    parts: list[torch.Tensor] = []
    for t in tensors:
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        parts.append(raw)
        if pad := _padded(raw.numel()) - raw.numel():
            parts.append(torch.zeros(pad, dtype=torch.uint8))
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


class Body:
    """A received body, read front to back in the order its tensors were packed."""

    def __init__(self, data: torch.Tensor) -> None:
        self.data, self.at = data, 0

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = torch.Size(shape).numel() * dtype.itemsize
        if self.at + n > self.data.numel():
            raise RuntimeError(
                f"a message body of {self.data.numel()} bytes is too short for {shape} {dtype} at byte {self.at}: "
                "the two sides run different deltafind versions; run the same one on every machine"
            )
        out = self.data[self.at : self.at + n].view(dtype).reshape(shape)
        self.at += _padded(n)
        return out

    def text(self, n: int) -> str:
        return bytes(self.take((n,), torch.uint8).tolist()).decode(errors="replace")


def recv_message(link: Pair, size: int, deadline: float | None) -> tuple[list[int], Body]:
    """A header of `size` fields and its body, waiting until `deadline` (time.monotonic; None: as long as it takes)."""
    *header, nbytes = recv(link, (size + 1,), torch.int64, deadline).tolist()
    return header, Body(recv(link, (nbytes,), torch.uint8, deadline))


def recv(
    link: Pair, shape: tuple[int, ...], dtype: torch.dtype, deadline: float | None
) -> torch.Tensor:
    """One tensor of exactly this shape and dtype from the other side of `link` (gloo checks the size)."""
    out = torch.empty(shape, dtype=dtype)
    if out.numel():
        work = link.recv([out], 1 - link.rank(), 0)
        work.wait(
            FOREVER
            if deadline is None
            else timedelta(seconds=max(deadline - time.monotonic(), 0.001))
        )
    return out


def _padded(n: int) -> int:
    return -(-n // 8) * 8


def text(message: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(message.encode()), dtype=torch.uint8)
