"""The process group of a cluster and the per-layer messages over it (torch.distributed point-to-point).

Rank 0 is the coordinator, ranks 1..N the expert nodes. A message is a fixed int64 header, then
the tensors whose sizes it gives; gloo (or NCCL) carries them, in order per pair of ranks, so no
socket protocol of our own sits on the hot path. Knows tensors and ranks, never models or stores.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from deltafind.config import ClusterSettings
from deltafind.errors import ConfigError, DeltafindError

OP_RUN, OP_PREFETCH, OP_STOP, OP_PLACEMENT = 1, 2, 3, 4
# request: op, layer, experts, rows, dim, dtype, predicted layer, predicted experts (-1: the previous route)
REQUEST = 8
# reply: status (0 ok, 1 error), error bytes, out dtype, bytes read, experts read, cache hits, read wait us, read kB/s
REPLY = 8
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.uint8)
FOREVER = timedelta(days=365)  # a node waits this long for the next request (a wait without one would use the group's)
DEFAULT_PORT = 29500
_PAIRS: dict[int, Any] = {}  # node rank -> the group of the coordinator and that node


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


def group_spec(cluster: ClusterSettings, device: torch.device) -> GroupSpec:
    """`[cluster]` (and $RANK/$WORLD_SIZE/$MASTER_ADDR/$MASTER_PORT, merged by the config) as a checked spec."""
    if cluster.world_size is None:
        raise ConfigError("[cluster] world_size is unset (and $WORLD_SIZE too): set it to 1 + the number of expert nodes")
    rank = cluster.rank if cluster.rank is not None else 0
    if cluster.role == "coordinator" and rank != 0:
        raise ConfigError(f"[cluster] role = \"coordinator\" needs rank 0, not {rank}: the expert nodes are ranks 1..{cluster.world_size - 1}")
    if cluster.role == "expert" and not 1 <= rank < cluster.world_size:
        raise ConfigError(f"[cluster] role = \"expert\" needs a rank from 1 to {cluster.world_size - 1} (world_size - 1), not {rank}")
    if cluster.backend == "nccl":  # TODO(cluster): device tensors on the wire; untested here (one GPU cannot host two NCCL ranks)
        raise ConfigError("[cluster] backend = \"nccl\" is not supported yet (the exchange moves CPU tensors): "
                          "set backend = \"gloo\" (or auto)")
    backend = "gloo"
    return GroupSpec(rank, cluster.world_size, cluster.coordinator or "127.0.0.1", cluster.port or DEFAULT_PORT,
                     backend, cluster.join_timeout_s, cluster.timeout_s)


def join(spec: GroupSpec) -> None:
    """Form the process group (blocks until every rank has joined, up to `join_timeout_s`)."""
    where = f"tcp://{spec.address}:{spec.port}"
    try:
        dist.init_process_group(spec.backend, init_method=where, rank=spec.rank, world_size=spec.world_size,
                                timeout=timedelta(seconds=spec.join_timeout_s))
        # One group per (coordinator, node) pair: a timed-out wait closes every pair of its group (gloo),
        # so each node gets its own and a stalled node cannot take the others down with it.
        _PAIRS.clear()
        _PAIRS.update({r: dist.new_group([0, r]) for r in range(1, spec.world_size)})
    except (RuntimeError, ValueError, OSError) as e:
        raise ClusterError(f"rank {spec.rank} of {spec.world_size} could not join the cluster at {where} ({spec.backend}): {e}; "
                           "check [cluster] coordinator/port (or MASTER_ADDR/MASTER_PORT), that every node runs, "
                           "and the firewall") from None


def leave() -> None:
    _PAIRS.clear()
    if dist.is_initialized():
        dist.destroy_process_group()


def _pair(peer: int) -> Any:
    """The group of this rank and `peer` (one side is always the coordinator, rank 0)."""
    return _PAIRS[peer if peer else dist.get_rank()]


def dtype_code(dtype: torch.dtype) -> int:
    return DTYPES.index(dtype)


def send(peer: int, header: list[int], *tensors: torch.Tensor) -> list[dist.Work]:
    """Start sending a header and its tensors to `peer`; the caller waits the works."""
    group = _pair(peer)
    works = [dist.isend(torch.tensor(header, dtype=torch.int64), peer, group=group)]
    works += [dist.isend(t.contiguous(), peer, group=group) for t in tensors if t.numel()]
    return works


def recv(peer: int, shape: tuple[int, ...], dtype: torch.dtype, deadline: float | None) -> torch.Tensor:
    """A tensor from `peer`, waiting until `deadline` (time.monotonic; None: as long as it takes)."""
    out = torch.empty(shape, dtype=dtype)
    if out.numel():
        work = dist.irecv(out, peer, group=_pair(peer))
        wait = FOREVER if deadline is None else timedelta(seconds=max(deadline - time.monotonic(), 0.001))
        work.wait(wait)
    return out


def recv_header(peer: int, size: int, deadline: float | None) -> list[int]:
    return recv(peer, (size,), torch.int64, deadline).tolist()


def text(message: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(message.encode()), dtype=torch.uint8)
