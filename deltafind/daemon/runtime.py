"""The worker's runtime: load the model after fork, warm up, serve, reload, drain.

Runs inside the one gunicorn worker. A loader thread opens the store (the app
answers 503 model_loading meanwhile, and gunicorn's heartbeat keeps flowing),
runs a one-token warm-up, then hands the app a ReadyEngine and tells systemd
READY=1. This is the one place that wires concrete objects: Model, Scheduler,
app state and the control service.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from deltafind import __version__
from deltafind.config import Settings, changed_keys, load_settings
from deltafind.daemon import notify
from deltafind.engine.sampler import SamplingParams
from deltafind.engine.scheduler import Scheduler, SchedulerLimits, collect
from deltafind.engine.sequence import GenRequest
from deltafind.errors import ConfigError, DeltafindError
from deltafind.log import configure_logging, get_logger
from deltafind.server import AppState, ReadyEngine, ServerConfig

log = get_logger(__name__)
MAX_STEP_TOKENS = 256
PREFIX_CACHE_BYTES = 256 << 20  # finished conversations' KV kept for exact prefix reuse


def read_key_file(path: Path | None) -> list[str]:
    if path is None:
        return []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read server.api_key_file: {e.strerror or e}") from None
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def server_config(settings: Settings) -> ServerConfig:
    s = settings.server
    keys = tuple(dict.fromkeys([*s.api_keys, *read_key_file(s.api_key_file)]))
    return ServerConfig(keys, int(s.max_body_bytes), s.max_tokens_default, s.max_context)


def store_dir(settings: Settings) -> Path:
    if settings.model.store is None:
        from deltafind.errors import StoreError

        raise StoreError("no store to serve: set [model] store in the config or pass --store DIR")
    return Path(settings.model.store).expanduser()


def model_name(settings: Settings) -> str:
    return settings.model.name or store_dir(settings).name


class Runtime:
    def __init__(self, settings: Settings, config_path: Path | None, overrides: dict[str, Any], state: AppState) -> None:
        self.settings, self.config_path, self.overrides, self.state = settings, config_path, overrides, state
        self.config_loaded_at = time.time()
        self.started_at = time.time()
        self.model: Any = None
        self.scheduler: Scheduler | None = None
        self.pending_restart: list[str] = []
        self.trace_path: str | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.control: Any = None

    # -- start ---------------------------------------------------------------

    def start(self) -> None:
        threading.Thread(target=self._load, name="deltafind-loader", daemon=True).start()
        notify.start_watchdog(self.healthy, self._stop)
        self._start_control()

    def _start_control(self) -> None:
        from deltafind.control.service import ControlServer

        c = self.settings.control
        try:
            self.control = ControlServer(self, c.socket, int(c.mode), c.group)
            self.control.start()
        except (OSError, DeltafindError) as e:
            log.error("control_socket_failed", socket=str(c.socket), error=str(e))

    def _load(self) -> None:
        try:
            t0 = time.monotonic()
            notify.status("loading model")
            extender = threading.Thread(target=self._extend_while_loading, daemon=True)
            extender.start()
            self.model = self._open_model()
            s = self.settings
            args = getattr(self.model.net, "args", None)
            context = int(getattr(args, "max_position_embeddings", 0) or 4096)
            draft, policy = self._draft(s)
            self.scheduler = Scheduler(self.model.net, self.model.eos_token_ids, self._limits(s, context),
                                       draft=draft, draft_policy=policy)
            notify.status("warming up")
            tok = self.model.tokenizer
            first = (tok.encode("Hi") or [tok.bos_token_id or 0])[:1]
            _, fin = collect(self.scheduler.submit(GenRequest(tuple(first), SamplingParams(max_new_tokens=1))), timeout=600)
            if fin.reason == "error":
                raise DeltafindError(f"warm-up failed: {fin.error}")
            self.context_length = context
            self.state.set_ready(ReadyEngine(self.scheduler, tok, model_name(s), context, extra_metrics=self.store_metrics))
            log.info("model_ready", store=str(store_dir(s)), family=self.model.manifest.family,
                     load_s=round(time.monotonic() - t0, 2), context=context)
            notify.ready(f"serving {model_name(s)}")
        except Exception as e:
            code = e.exit_code if isinstance(e, DeltafindError) and e.exit_code in (3, 4) else 4
            log.error("model_load_failed", error=str(e), exc_info=not isinstance(e, DeltafindError))
            self.state.set_failed(str(e))
            notify.status(f"model load failed: {e}")
            for h in __import__("logging").getLogger().handlers:
                h.flush()
            os._exit(code)  # gunicorn's arbiter halts on exit code 3 (boot error) or 4 (app load error)

    def _extend_while_loading(self) -> None:
        while self.state.engine is None and self.state.load_status == "loading":
            notify.extend_timeout(60)
            if self._stop.wait(20):
                return

    def _open_model(self) -> Any:
        import torch

        from deltafind.api import Model
        from deltafind.store.experts import PrefetchOptions
        from deltafind.store.reader import DriveOptions

        s = self.settings
        if s.device.threads:
            torch.set_num_threads(s.device.threads)
        p = s.prefetch
        return Model.open(
            store_dir(s), device=s.device.kind,  # resolved (auto: CUDA, MPS, CPU) and probed by Model.open
            expert_cache_bytes=int(s.cache.expert_bytes),
            dtype=s.device.dtype, drives=[DriveOptions(d.path, d.queue_depth, d.read_mb_s) for d in s.drives],
            prefetch=PrefetchOptions(p.enabled, p.max_in_flight, p.recall_threshold),
            pin_bytes=int(s.cache.pin_bytes), heat_decay=s.cache.heat_decay,
            spine_bytes=None if s.cache.spine_bytes is None else int(s.cache.spine_bytes),
            compile_kernels=s.device.compile,
        )

    def _draft(self, s: Settings) -> tuple[Any, Any]:
        """[draft] as a source and policy; mode "on" without a usable source fails the load."""
        from deltafind.api import Model, open_cross_draft
        from deltafind.engine.draft.base import DraftError
        from deltafind.engine.draft.load import source_from_settings

        model = self.model
        device = model.net.lm_head.weight.device

        def open_model(path: Path) -> Any:
            m = Model.open(path, device=device, dtype=s.device.dtype)
            model._draft_models.append(m)  # closed with the target
            return m

        def open_cross(paths: list[Path]) -> Any:
            # chat requests never use it (GenRequest.chat; the scheduler checks raw_only)
            return open_cross_draft(model.tokenizer, paths, open_model=open_model)

        try:
            source, policy = source_from_settings(s.draft, model.net, target_store=store_dir(s), open_store=lambda p: open_model(p).net,
                                                  device=device, open_cross=open_cross)
        except DraftError as e:
            raise DeltafindError(f"[draft] mode = \"on\" but source {s.draft.source!r} cannot draft: {e}; "
                                 "set [draft] mode = \"auto\" to run without it") from e
        if source is not None:
            log.info("draft_ready", source=source.name, mode=policy.mode, max_width=policy.max_width)
        return source, policy

    @staticmethod
    def _limits(s: Settings, context: int) -> SchedulerLimits:
        max_context = min(s.server.max_context or context, context)
        return SchedulerLimits(s.server.max_running, s.server.max_queue, max(MAX_STEP_TOKENS, s.server.max_running),
                               max_context, PREFIX_CACHE_BYTES)

    def healthy(self) -> bool:
        return self.scheduler is None or self.scheduler._thread.is_alive()

    # -- reload ----------------------------------------------------------------

    def reload(self) -> dict[str, Any]:
        """Re-read the config; apply what can change live. An invalid file changes nothing."""
        with self._lock:
            notify.reloading()
            try:
                try:
                    new = load_settings(self.config_path, self.overrides)
                    new_server = server_config(new)
                except ConfigError as e:
                    log.warning("reload_rejected", error=str(e))
                    return {"ok": False, "message": str(e), "applied": [], "restart_needed": self.pending_restart}
                live, restart = changed_keys(self.settings, new)
                self._apply(new, new_server, live)
                self.settings = self._merge(self.settings, new, live)
                self.pending_restart = sorted(set(restart))
                self.config_loaded_at = time.time()
                log.info("reloaded", applied=live, restart_needed=self.pending_restart)
                msg = "reloaded" + (f"; restart to apply {', '.join(self.pending_restart)}" if self.pending_restart else "")
                return {"ok": True, "message": msg, "applied": live, "restart_needed": self.pending_restart}
            finally:
                notify.ready(f"serving {model_name(self.settings)}")

    @staticmethod
    def _merge(old: Settings, new: Settings, live: list[str]) -> Settings:
        update: dict[str, Any] = {}
        for key in live:
            section, _, sub = key.partition(".")
            base = update.get(section, getattr(old, section))
            update[section] = base.model_copy(update={sub: getattr(getattr(new, section), sub)}) if sub else getattr(new, section)
        return old.model_copy(update=update)

    def _apply(self, new: Settings, new_server: ServerConfig, live: list[str]) -> None:
        self.state.config = new_server  # keys, body limit, max_tokens default, max_context (key file re-read too)
        if "logging.level" in live:
            configure_logging(new.logging.level, new.logging.format)
        sched, model = self.scheduler, self.model
        if sched is None or model is None:
            return
        sched.configure(self._limits(new, self.context_length))
        if any(k.startswith("draft.") for k in live):
            from deltafind.engine.draft.policy import PolicyOptions

            d = new.draft
            sched.configure_draft(PolicyOptions(mode="auto" if d.mode == "off" else d.mode, max_width=d.max_width),
                                  enabled=d.mode != "off")
            if d.mode != "off" and sched.draft is None:
                log.warning("draft_reload_needs_restart", reason="started with [draft] mode = \"off\"; no source is loaded")

        def on_engine() -> None:
            from deltafind.store.experts import PrefetchOptions
            from deltafind.store.heat import hottest, read_heat

            ex = model.experts
            if "cache.expert_bytes" in live:
                ex.cache.resize(int(new.cache.expert_bytes))
            if any(k.startswith("prefetch.") for k in live):
                p = new.prefetch
                ex.prefetch_options = PrefetchOptions(p.enabled, p.max_in_flight, p.recall_threshold)
            if "cache.heat_decay" in live:
                model.heat_decay = new.cache.heat_decay
            if "cache.pin_bytes" in live:
                ex.pinned.clear()
                ex.pinned_bytes = 0
                if int(new.cache.pin_bytes):
                    ex.pin(hottest(read_heat(model.store_dir)), int(new.cache.pin_bytes))

        sched.call(on_engine)

    # -- drain / trace / status ------------------------------------------------

    def drain(self, grace_s: float | None = None, wait: bool = False) -> None:
        """Refuse new requests; after `grace_s` cancel what still runs (None: never)."""
        if self.scheduler is None:
            return
        self.scheduler.drain()
        log.info("draining", grace_s=grace_s, active=self.scheduler.num_active)
        if grace_s is None:
            return
        sched = self.scheduler

        def cancel_after_grace() -> None:
            deadline = time.monotonic() + grace_s
            while sched.num_active and time.monotonic() < deadline:
                time.sleep(0.1)
            if sched.num_active:
                log.warning("drain_grace_over", cancelled=sched.cancel_all())

        t = threading.Thread(target=cancel_after_grace, name="deltafind-drain", daemon=True)
        t.start()
        if wait:
            t.join()

    def resume(self) -> None:
        if self.scheduler is not None:
            self.scheduler.resume()

    def trace(self, start: bool, path: str | None) -> dict[str, Any]:
        if self.scheduler is None or self.model is None:
            raise DeltafindError("the model is still loading; try again when it is ready")
        from deltafind.store.trace import TraceWriter

        experts = self.model.experts

        def swap() -> None:
            if experts.trace is not None:
                experts.trace.close()
                experts.trace = None
            if start:
                experts.trace = TraceWriter(Path(path or "deltafind-trace.jsonl"))

        self.scheduler.call(swap)
        self.trace_path = (path or "deltafind-trace.jsonl") if start else None
        log.info("trace", active=start, path=self.trace_path)
        return {"active": start, "path": self.trace_path or ""}

    def status(self) -> dict[str, Any]:
        s = self.settings
        out: dict[str, Any] = {
            "model": model_name(s), "version": __version__, "pid": os.getpid(), "uptime_s": time.time() - self.started_at,
            "ready": self.state.engine is not None, "load_status": self.state.load_status,
            "config_path": str(self.config_path or ""), "config_loaded_at": self.config_loaded_at,
            "restart_needed": list(self.pending_restart), "trace_path": self.trace_path or "",
            "draining": False, "running": 0, "waiting": 0, "tok_s": 0.0, "drives": [],
        }
        if self.scheduler is not None:
            st = self.scheduler.status()
            out.update(draining=st.draining, running=st.running, waiting=st.waiting, tok_s=st.tok_s,
                       steps=st.stats.steps, generated_tokens=st.stats.generated_tokens, max_running=st.limits.max_running,
                       max_queue=st.limits.max_queue, prefix_hits=st.prefix_hits)
            d = st.stats.draft
            out.update(draft_source=getattr(self.scheduler.draft, "name", ""),
                       draft_mode=self.scheduler.draft_policy.mode if self.scheduler._draft_enabled else "off",
                       draft_proposed=d.proposed, draft_accepted=d.accepted, draft_acceptance_rate=d.acceptance_rate,
                       draft_verify_passes=d.steps, draft_saved_s=d.saved_s, draft_failures=d.failures)
        if self.model is not None:
            ex = self.model.experts
            e = ex.stats
            layers = list(e.layers.values())
            needed = sum(r.needed for r in layers)
            out.update(
                cache_requested=e.requested, cache_hits=e.cache_hits, pinned_hits=e.pinned_hits,
                cache_hit_rate=(e.cache_hits + e.pinned_hits) / e.requested if e.requested else 0.0,
                cache_used_bytes=ex.cache.used_bytes, cache_budget_bytes=ex.cache.budget_bytes or 0,
                pinned_bytes=ex.pinned_bytes, experts_read=e.read, bytes_read=e.bytes_read,
                prefetch_issued=e.prefetch_issued, prefetch_used=e.prefetch_used, prefetch_wasted=e.prefetch_wasted,
                prefetch_recall=sum(r.hits for r in layers) / needed if needed else 0.0,
            )
            remote, total = ex.reader.remote, ex.manifest.expert_bytes()  # a streaming install fills as it serves
            out.update(store_bytes_total=total, store_bytes_present=remote.present_bytes() if remote is not None else total)
            for i, (path, d) in enumerate(zip(ex.reader.paths, ex.reader.stats, strict=True)):
                out["drives"].append({"index": i, "path": str(path), "healthy": os.access(path, os.R_OK),
                                      "reads": d.reads, "bytes_read": d.bytes, "read_gb_s": d.gb_s})
        return out

    def store_metrics(self) -> list[tuple[str, str, str, list[tuple[dict[str, str], float]]]]:
        st = self.status()
        if self.model is None:
            return []
        drives = st["drives"]
        return [
            ("deltafind_expert_requests_total", "counter", "Expert fetches asked by the model.", [({}, float(st["cache_requested"]))]),
            ("deltafind_expert_cache_hits_total", "counter", "Expert fetches served from memory, by tier.",
             [({"tier": "cache"}, float(st["cache_hits"])), ({"tier": "pinned"}, float(st["pinned_hits"]))]),
            ("deltafind_expert_cache_hit_ratio", "gauge", "Share of expert fetches served from memory.", [({}, st["cache_hit_rate"])]),
            ("deltafind_expert_cache_bytes", "gauge", "Bytes of experts held in the cache.", [({}, float(st["cache_used_bytes"]))]),
            ("deltafind_drive_read_bytes_total", "counter", "Bytes read per drive.",
             [({"drive": str(d["index"])}, float(d["bytes_read"])) for d in drives]),
            ("deltafind_drive_healthy", "gauge", "1 when the drive's pack is readable.",
             [({"drive": str(d["index"])}, float(d["healthy"])) for d in drives]),
            ("deltafind_prefetch_recall", "gauge", "Share of routed experts that prefetch predicted.", [({}, st["prefetch_recall"])]),
            ("deltafind_prefetch_reads_total", "counter", "Prefetch reads, by outcome.",
             [({"outcome": "issued"}, float(st["prefetch_issued"])), ({"outcome": "used"}, float(st["prefetch_used"])),
              ({"outcome": "wasted"}, float(st["prefetch_wasted"]))]),
        ]

    def close(self) -> None:
        self._stop.set()
        if self.control is not None:
            self.control.stop()
        if self.scheduler is not None:
            self.scheduler.close()
        if self.model is not None:
            self.model.close()
