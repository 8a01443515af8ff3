"""An expert node (`deltafind node`): holds some routed experts on its drives and runs them for the coordinator.

It opens its store as one machine does (drive pools, byte-budgeted cache, prefetch), builds the
family's modules without weights (meta device) to take each routed layer's `run`, joins the
group, then answers requests: a prediction for the next layer starts its reads, then each
requested expert is fetched and run on its rows, and the outputs go back, one per expert.
Never loads the spine; never sums experts (the coordinator does, in expert order).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from deltafind.cluster import wire
from deltafind.cluster.placement import Placement
from deltafind.config import Settings
from deltafind.device.select import start_device
from deltafind.device.staging import make_stager, read_buffer_pool
from deltafind.errors import ConfigError, StoreError
from deltafind.log import get_logger
from deltafind.models.contract import Run
from deltafind.models.ops.stored import hold_dtype
from deltafind.models.registry import family_module
from deltafind.store.experts import StoreExperts
from deltafind.store.heat import hottest, read_heat
from deltafind.store.manifest import Manifest

log = get_logger(__name__)


class ExpertNode:
    """One node's store and routed layers; `serve()` answers the coordinator until told to stop."""

    def __init__(self, settings: Settings) -> None:
        if settings.cluster.role != "expert":
            raise ConfigError(
                "`deltafind node` needs [cluster] role = \"expert\" (and rank, world_size, coordinator, port)"
            )
        if settings.model.store is None:
            raise StoreError(
                "no store for this expert node: set [model] store (a store holding this node's experts)"
            )
        if settings.device.threads:
            torch.set_num_threads(settings.device.threads)
        self.settings = settings
        self.device = start_device(settings.device.kind)
        self.spec = wire.group_spec(settings.cluster)
        self.store_dir = Path(settings.model.store).expanduser()
        manifest = Manifest.load(self.store_dir)
        hold = hold_dtype(
            {getattr(torch, t.dtype) for r in manifest.experts for t in r.tensors},
            getattr(torch, settings.device.dtype),
        )
        self.experts = StoreExperts.from_settings(
            settings,
            manifest,
            self.store_dir,
            hold,
            stager=make_stager(self.device),
            buffer_pool=read_buffer_pool(self.device),
        )
        family = family_module(manifest.family)
        with torch.device("meta"):
            net = family.Model(family.ModelArgs.from_config(manifest.model_config), self.experts)
        self.runs: dict[int, Run] = net.routed_runs()
        self.mine: list[tuple[int, int]] = []
        self.link: wire.Pair = None  # this generation's group with the coordinator

    def serve(self) -> int:
        """Join, then answer requests; 0 when the coordinator stops us, 1 when it is lost (a restart joins again)."""
        log.info(
            "cluster_joining",
            rank=self.spec.rank,
            world_size=self.spec.world_size,
            address=self.spec.address,
            port=self.spec.port,
            backend=self.spec.backend,
        )
        store = wire.meet(self.spec)
        gen = wire.announce(store, self.spec.rank, self.spec.join_timeout_s)
        self.link = wire.pair(store, self.spec, self.spec.rank, gen)
        try:
            while True:
                try:
                    header, body = wire.recv_message(self.link, wire.REQUEST, None)
                    if header[0] == wire.OP_STOP:
                        log.info("cluster_node_stopped", rank=self.spec.rank)
                        return 0
                    self._handle(body, *header)
                except (
                    RuntimeError
                ) as e:  # gloo: the coordinator went away, or gave up on us (timed out)
                    log.error(
                        "cluster_coordinator_lost",
                        rank=self.spec.rank,
                        generation=gen,
                        error=str(e)[:300],
                    )
                    return 1
        finally:
            self.experts.close()
            self.link = None

    def _handle(
        self,
        body: wire.Body,
        op: int,
        layer: int,
        n_ids: int,
        n_rows: int,
        dim: int,
        dtype: int,
        pred_layer: int,
        n_pred: int,
    ) -> None:
        if op == wire.OP_PLACEMENT:
            self._answer(partial(self._take_placement, body.text(n_rows)))
            return
        head = body.take((2 * n_ids + max(n_pred, 0),), torch.int64).tolist()
        ids, counts, pred = head[:n_ids], head[n_ids : 2 * n_ids], head[2 * n_ids :]
        index = body.take((sum(counts),), torch.int64) if n_ids else None
        x = body.take((n_rows, dim), wire.DTYPES[dtype]) if n_rows else None
        # before this layer's reads are queued, as on one machine (models/ops/step.py)
        if pred_layer >= 0:
            self.experts.prefetch(pred_layer, None if n_pred < 0 else pred)
        if op == wire.OP_RUN:
            self._answer(partial(self._run, layer, ids, counts, index, x))

    def _take_placement(self, blob: str) -> torch.Tensor:
        placement = Placement.from_json(json.loads(blob))
        self.mine = placement.experts_of(self.spec.rank)
        for layer, e in self.mine:
            if layer not in self.runs:
                raise StoreError(
                    f"layer {layer} of the coordinator's model has no routed experts in this node's store "
                    f"{self.store_dir}: the node serves another model; point [model] store at the same model"
                )
            self.experts.record(
                layer, e
            )  # raises, naming the expert, when this node's store lacks it
        if int(self.settings.cache.pin_bytes):
            mine = set(self.mine)
            self.experts.resident.pin(
                [k for k in hottest(read_heat(self.store_dir)) if k in mine],
                int(self.settings.cache.pin_bytes),
            )
        log.info(
            "cluster_node_ready",
            rank=self.spec.rank,
            experts=len(self.mine),
            store=str(self.store_dir),
        )
        return torch.empty(0)

    def _run(
        self,
        layer: int,
        ids: list[int],
        counts: list[int],
        index: torch.Tensor | None,
        x: torch.Tensor | None,
    ) -> torch.Tensor:
        assert x is not None and index is not None
        x = x.to(self.device)
        rows = {
            e: x[i] for e, i in zip(ids, torch.split(index.to(self.device), counts), strict=True)
        }  # exact gathers
        run = self.runs[layer]
        out = {e: run(rows[e], expert) for e, expert in self.experts.fetch(layer, ids)}
        return (
            torch.cat([out[e] for e in ids]).cpu()
            if self.spec.backend == "gloo"
            else torch.cat([out[e] for e in ids])
        )

    def _answer(self, compute: Callable[[], torch.Tensor]) -> None:
        """Send the result of `compute()` (or its error, which fails only the coordinator's request)."""
        s = self.experts.stats
        drives = self.experts.reader.stats
        span = sum(d.last_t - d.first_t for d in drives)
        rate_kb_s = int(sum(d.bytes for d in drives) / span / 1e3) if span > 0 else 0
        try:
            y = compute()
            head = [0, 0, wire.dtype_code(y.dtype)]
        except Exception as e:  # any failure is this request's; the node keeps serving
            log.error(
                "cluster_node_request_failed", rank=self.spec.rank, error=f"{type(e).__name__}: {e}"
            )
            y = wire.text(f"{type(e).__name__}: {e}")
            head = [1, y.numel(), 0]
        stats = [s.bytes_read, s.read, s.cache_hits + s.pinned_hits, int(s.wait_s * 1e6), rate_kb_s]
        works = wire.send(self.link, [*head, *stats], y)
        for w in works:
            w.wait(wire.FOREVER)


def serve_node(settings: Settings) -> int:
    """`deltafind node`: run this expert node until the coordinator stops it."""
    return ExpertNode(settings).serve()
