"""The coordinator's `ExpertProvider`: routed experts computed on the expert nodes, the rest local.

`moe.dispatch` hands `run_experts` each chosen expert's rows; they go to a live node holding that
expert (the next layer's predicted experts ride along, so the node starts reading early), and
each node returns one output per expert, which dispatch sums in expert order exactly as one
machine does. Dense slices, router traces and heat stay with the local store. A node that dies,
stalls past `[cluster] timeout_s` or fails a layer fails the requests in flight (ClusterError);
a node that died or stalled is marked down and its experts' other copies serve from then on, until
it is restarted: a watcher thread sees its new generation in the group's store, forms a group with
it, hands it the placement and serves from it again (the coordinator keeps running).
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from deltafind.cluster import wire
from deltafind.cluster.placement import Placement, check_placement, make_placement, read_placement
from deltafind.cluster.wire import ClusterError, GroupSpec
from deltafind.log import get_logger
from deltafind.models.contract import Run
from deltafind.provider import Expert
from deltafind.store.experts import StoreExperts
from deltafind.store.heat import read_heat

log = get_logger(__name__)
_NO_HINT = object()


@dataclass
class NodeState:
    """What the coordinator knows of one expert node (`deltafinctl status`, /health)."""

    rank: int
    experts: int
    alive: bool = True
    last_error: str = ""
    bytes_read: int = 0
    experts_read: int = 0
    cache_hits: int = 0
    read_wait_s: float = 0.0
    read_mb_s: float = 0.0
    layers: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    exchange_s: float = 0.0  # time from the first send of a layer to this node's reply
    joins: int = 0  # 1 once it joined; each restart that the coordinator took back adds one


class ClusterExperts:
    """Routed layers on the nodes, everything else from `local`; `start(net)` forms the group."""

    def __init__(
        self, local: StoreExperts, spec: GroupSpec, store_dir: Path, hot_replicas: float = 0.0
    ) -> None:
        self.local, self.spec, self.store_dir, self.hot_replicas = (
            local,
            spec,
            Path(store_dir),
            hot_replicas,
        )
        self.dtype = local.dtype
        self.routed: set[int] = set()
        self.placement = Placement(spec.world_size - 1, {})
        self.nodes: dict[int, NodeState] = {}
        self._ride: dict[
            int, Sequence[int] | None
        ] = {}  # layer -> prediction to send with the previous layer's rows
        self._store: Any = None  # where the nodes announce themselves (wire.meet)
        self._links: dict[int, wire.Pair] = {}  # node -> its group with us, this generation
        self._gen: dict[int, int] = {}  # node -> the generation we serve from
        self._lock = threading.Lock()  # a node's link and liveness change only between exchanges
        self._closing = threading.Event()
        self._watcher: threading.Thread | None = None
        self._outbox: dict[int, list[Any]] = {}  # node -> sends that may still be running
        self._hinted: dict[
            int, dict[int, int]
        ] = {}  # layer -> predicted expert -> the node reading it
        self._served: Counter[int] = (
            Counter()
        )  # node -> experts it ran: where a tie between copies goes

    # -- forming the cluster -------------------------------------------------------------------

    def start(self, net: nn.Module) -> None:
        """Place the routed experts of `net`, join the group and hand every node its placement."""
        runs: Mapping[int, Run] = net.routed_runs()
        self.routed = set(runs)
        counts = {layer: self.local.num_experts(layer) for layer in sorted(runs)}
        num_nodes = self.spec.world_size - 1
        placement = read_placement(self.store_dir)
        if placement is not None:
            check_placement(placement, counts, num_nodes, self.store_dir)
        else:
            placement = make_placement(
                counts, num_nodes, read_heat(self.store_dir), None, self.hot_replicas
            )
        self.placement = placement
        self.nodes = {
            r: NodeState(r, len(placement.experts_of(r))) for r in range(1, num_nodes + 1)
        }
        log.info(
            "cluster_joining",
            rank=0,
            world_size=self.spec.world_size,
            address=self.spec.address,
            port=self.spec.port,
            backend=self.spec.backend,
        )
        self._store = wire.meet(self.spec)
        self._store.set("deltafind/protocol0", str(wire.PROTOCOL))
        deadline = time.monotonic() + self.spec.join_timeout_s
        problems = []
        for r in self.nodes:
            try:
                self._welcome(r, wire.generation(self._store, r, deadline), deadline)
            except ClusterError as e:
                problems.append(str(e))
        if problems:
            raise ClusterError("the expert nodes did not join: " + "; ".join(problems))
        self._watcher = threading.Thread(
            target=self._watch, name="deltafind-cluster-watch", daemon=True
        )
        self._watcher.start()
        log.info(
            "cluster_ready",
            nodes=num_nodes,
            routed_layers=len(self.routed),
            experts=len(placement.owners),
        )

    # -- the provider contract -----------------------------------------------------------------

    def num_experts(self, layer_idx: int) -> int:
        return self.local.num_experts(layer_idx)

    def fetch(self, layer_idx: int, expert_ids: Sequence[int]) -> Iterable[tuple[int, Expert]]:
        # dense slices (routed layers go through run_experts)
        return self.local.fetch(layer_idx, expert_ids)

    def dense_held(self, layer_idx: int) -> Sequence[Expert] | None:
        return self.local.dense_held(layer_idx)

    def held_chain(self, num_layers: int) -> Sequence[Sequence[Expert]] | None:
        return self.local.held_chain(num_layers)

    def begin_step(self, seq_ids: Sequence[int], positions: Sequence[int]) -> None:
        self.local.begin_step(seq_ids, positions)

    def enter_layer(self, layer_idx: int) -> None:
        self.local.enter_layer(layer_idx)

    def observe_routes(
        self, layer_idx: int, topk_idx: torch.Tensor, topk_weight: torch.Tensor
    ) -> None:
        self.local.observe_routes(layer_idx, topk_idx, topk_weight)

    def wants_prefetch(self, layer_idx: int) -> bool:
        # a routed layer's hint goes to the nodes, whose caches are their own
        return layer_idx in self.routed or self.local.wants_prefetch(layer_idx)

    def prefetch(self, layer_idx: int, expert_ids: Sequence[int] | None) -> None:
        if layer_idx not in self.routed:
            self.local.prefetch(layer_idx, expert_ids)
        elif layer_idx - 1 in self.routed:
            self._ride[layer_idx] = expert_ids  # rides with the previous layer's rows
        else:
            with self._lock:
                for r, ids in self._hints(layer_idx, expert_ids).items():
                    n = -1 if ids is None else len(ids)
                    head = [wire.OP_PREFETCH, -1, 0, 0, 0, 0, layer_idx, n]
                    self._send(r, head, torch.tensor(ids or [], dtype=torch.int64))

    def run_experts(
        self, layer_idx: int, x: torch.Tensor, tokens: Mapping[int, torch.Tensor], run: Run
    ) -> Iterator[tuple[int, torch.Tensor]]:
        """(expert, its output on x[tokens[expert]]), each computed by a node holding it. A node gets
        each token's row once, with each expert's indices into them (a gather there is exact)."""
        with self._lock:
            out = self._exchange(layer_idx, x, tokens)
        yield from out.items()

    def _exchange(
        self, layer_idx: int, x: torch.Tensor, tokens: Mapping[int, torch.Tensor]
    ) -> dict[int, torch.Tensor]:
        hint = self._ride.pop(layer_idx + 1, _NO_HINT)
        hints = self._hints(layer_idx + 1, hint) if hint is not _NO_HINT else {}  # type: ignore[arg-type]
        # A predicted expert goes where its read was started (the prediction was balanced); the rest balance around them.
        fixed = {e: r for e, r in self._hinted.pop(layer_idx, {}).items() if self.nodes[r].alive}
        by_node, orphans = self.placement.assign(
            layer_idx, tokens, self._rates(), fixed, self._served
        )
        if orphans:
            e = orphans[0]
            owners = self.placement.owners.get((layer_idx, e), ())
            why = (
                "; ".join(f"node {r}: {self.nodes[r].last_error}" for r in owners)
                or "no node holds it"
            )
            raise ClusterError(
                f"expert {e} of layer {layer_idx} has no live copy ({why}); restart its nodes "
                "(`deltafind node`): the coordinator takes them back"
            )
        for e in tokens:
            self.local.uses[(layer_idx, e)] += 1  # heat is the coordinator's: it sees every route
        for r, es in by_node.items():
            self._served[r] += len(es)
        t0 = time.perf_counter()
        for r in sorted(set(by_node) | set(hints)):
            ids, pred = by_node.get(r, []), hints.get(r, [])
            rows, index = (
                _rows_once([tokens[e] for e in ids], x)
                if ids
                else (x[:0], x.new_empty(0, dtype=torch.int64))
            )
            header = [
                wire.OP_RUN if ids else wire.OP_PREFETCH,
                layer_idx,
                len(ids),
                rows.shape[0],
                x.shape[1],
                wire.dtype_code(x.dtype),
                layer_idx + 1 if r in hints else -1,
                -1 if pred is None else len(pred),
            ]
            head = torch.tensor(
                [*ids, *(len(tokens[e]) for e in ids), *(pred or [])], dtype=torch.int64
            )
            self._send(r, header, head, index.cpu(), rows)
        deadline = time.monotonic() + self.spec.timeout_s
        out: dict[int, torch.Tensor] = {}
        errors = []
        for r, ids in sorted(by_node.items()):
            sizes = [len(tokens[e]) for e in ids]
            try:
                if not self.nodes[r].alive:
                    raise ClusterError(self.nodes[r].last_error)
                y = self._reply(r, deadline, (sum(sizes), x.shape[1]))
                out.update(zip(ids, torch.split(y.to(x.device), sizes), strict=True))
            except ClusterError as e:
                errors.append(f"node {r}: {e}")
            self.nodes[r].exchange_s += time.perf_counter() - t0
            self.nodes[r].layers += 1
        if errors:
            raise ClusterError(
                f"layer {layer_idx}'s experts failed on the expert nodes ({'; '.join(errors)}); "
                "this request fails, the daemon keeps serving (deltafinctl status shows the nodes)"
            )
        return out

    # -- nodes ---------------------------------------------------------------------------------

    def _rates(self) -> dict[int, float]:
        """The live nodes and their read rates (MB/s, at least 1: below that a node's rate is not yet measured)."""
        return {r: max(n.read_mb_s, 1.0) for r, n in self.nodes.items() if n.alive}

    def _hints(self, layer_idx: int, ids: Sequence[int] | None) -> dict[int, list[int] | None]:
        """Each live node's share of a prediction (None: every holder reads as its previous route)."""
        if layer_idx not in self.routed:
            return {}
        out: dict[int, list[int] | None] = {}
        if ids is None:
            for (layer, _), ranks in self.placement.owners.items():
                for r in ranks:
                    if layer == layer_idx and self.nodes[r].alive:
                        out[r] = None
            return out
        queued, _ = self.placement.assign(
            layer_idx, ids, self._rates(), served=self._served
        )  # run_experts sends each to the copy that reads it
        self._hinted[layer_idx] = {e: r for r, es in queued.items() for e in es}
        return dict(queued)

    def _send(self, r: int, header: list[int], *tensors: torch.Tensor) -> None:
        """Start sending; never waited with a timeout (a timed-out wait closes the pair): the node's
        reply shows it got them, and sends still running then are kept until they complete."""
        node = self.nodes[r]
        if not node.alive:
            return
        try:
            self._outbox.setdefault(r, []).extend(wire.send(self._links[r], header, *tensors))
        except RuntimeError as e:
            self._down(r, f"send failed: {e}")
            return
        node.bytes_sent += wire.sent_bytes(header, *tensors)

    def _reply(self, r: int, deadline: float, shape: tuple[int, int] | None = None) -> torch.Tensor:
        """Node r's answer: its output [rows, dim] (or nothing for `shape` None); ClusterError on failure."""
        node = self.nodes[r]
        try:
            (status, err_len, dtype, *stats), body = wire.recv_message(
                self._links[r], wire.REPLY, deadline
            )
            node.bytes_read, node.experts_read, node.cache_hits = stats[0], stats[1], stats[2]
            node.read_wait_s, node.read_mb_s = stats[3] / 1e6, stats[4] / 1e3
            if status != 0:
                node.last_error = body.text(err_len)
                raise ClusterError(node.last_error)
            y = body.take(shape, wire.DTYPES[dtype]) if shape else torch.empty(0)
        except (
            RuntimeError
        ) as e:  # gloo: the peer closed, or the deadline passed (the pair is closed then too)
            self._down(r, f"no answer within {self.spec.timeout_s:g} s or connection lost ({e})")
            raise ClusterError(node.last_error) from None
        self._outbox[r] = [w for w in self._outbox.get(r, []) if not w.is_completed()]
        node.bytes_received += 8 * (wire.REPLY + 1) + body.data.numel()
        return y

    def _down(self, r: int, error: str) -> None:
        node = self.nodes[r]
        node.alive, node.last_error = False, error
        self._outbox.pop(r, None)
        log.error("cluster_node_down", rank=r, error=error[:500])

    def status(self) -> list[dict[str, Any]]:
        """Every node: alive, experts owned, read rate, last error, traffic."""
        return [asdict(n) for n in self.nodes.values()]

    def close(self) -> None:
        """Stop the nodes (they exit 0) and leave; the local store is its owner's to close."""
        self._closing.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5)
        with self._lock:
            for r in self._links:
                self._send(r, [wire.OP_STOP, 0, 0, 0, 0, 0, -1, 0])
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and any(
                not w.is_completed() for ws in self._outbox.values() for w in ws
            ):
                time.sleep(0.01)
            self._outbox.clear()
            self._links.clear()
            self._store = None

    # -- nodes joining and coming back ---------------------------------------------------------

    def _welcome(self, r: int, gen: int, deadline: float) -> None:
        """Form node r's group of generation `gen`, hand it the placement, then serve from it."""
        wire.check_protocol(self._store, r, 0)
        link = wire.pair(self._store, self.spec, r, gen)
        blob = wire.text(json.dumps(self.placement.to_json()))
        try:
            works = wire.send(link, [wire.OP_PLACEMENT, 0, 0, blob.numel(), 0, 0, -1, 0], blob)
            (status, err_len, *_), body = wire.recv_message(link, wire.REPLY, deadline)
            refusal = body.text(err_len) if status else ""
        except RuntimeError as e:
            raise ClusterError(f"node {r} joined and was lost ({e})") from None
        if refusal:
            raise ClusterError(f"node {r} refused the placement: {refusal}")
        with self._lock:
            self._links[r], self._outbox[r], self._gen[r] = link, works, gen
            node = self.nodes[r]
            node.alive, node.joins = True, node.joins + 1
        log.info("cluster_node_joined", rank=r, generation=gen, experts=node.experts)

    def _watch(self) -> None:
        """Until close: take back every node that restarted (a generation newer than the one we serve from)."""
        while not self._closing.wait(0.5):
            for r in self.nodes:
                try:
                    gen = wire.generation(self._store, r)
                    if gen <= self._gen[r]:
                        continue
                    self._gen[r] = (
                        gen  # this generation is tried once; the node's next restart is another
                    )
                    with self._lock:
                        if self.nodes[
                            r
                        ].alive:  # restarted before an exchange noticed: the old link is gone
                            self._down(r, f"restarted (generation {gen})")
                    self._welcome(r, gen, time.monotonic() + self.spec.join_timeout_s)
                except (ClusterError, RuntimeError) as e:
                    if self._closing.is_set():
                        return
                    self.nodes[r].last_error = str(e)
                    log.error("cluster_node_rejoin_failed", rank=r, error=str(e)[:500])


def _rows_once(tokens: list[torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct rows of x these experts use ([U, D], on the CPU for the wire) and, concatenated,
    each expert's indices into them."""
    every = torch.cat(tokens)
    distinct, index = torch.unique(every, sorted=True, return_inverse=True)
    return x[distinct].cpu(), index
