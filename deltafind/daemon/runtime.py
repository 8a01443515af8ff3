"""The worker's runtime: load the model after fork, warm up, serve, reload, drain.

Runs inside the one gunicorn worker. A loader thread opens the store (the app
answers 503 model_loading meanwhile, and gunicorn's heartbeat keeps flowing),
runs a one-token warm-up, then hands the app a ReadyEngine and tells systemd
READY=1. It holds what compose.py (the composition root) builds from settings:
Model, Scheduler, app state and the control service.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from deltafind import __version__
from deltafind.compose import model_name, scheduler_limits, server_config, store_dir
from deltafind.config import Settings, changed_keys, load_settings
from deltafind.daemon import files, notify
from deltafind.engine.sampler import SamplingParams
from deltafind.engine.scheduler import Scheduler, collect
from deltafind.engine.sequence import GenRequest
from deltafind.errors import ConfigError, DeltafindError
from deltafind.log import configure_logging, get_logger
from deltafind.server import AppState, ReadyEngine, ServerConfig
from deltafind.server.structured import prepare_vocabulary

log = get_logger(__name__)


class Runtime:
    def __init__(
        self,
        settings: Settings,
        config_path: Path | None,
        overrides: dict[str, Any],
        state: AppState,
    ) -> None:
        self.settings, self.config_path, self.overrides, self.state = (
            settings,
            config_path,
            overrides,
            state,
        )
        self.config_loaded_at = self.started_at = time.time()
        self.model: Any = None
        self.scheduler: Scheduler | None = None
        self.pending_restart: list[str] = []
        self._trace: Any = None
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
            from deltafind.api import Model

            self.model = Model.open(
                settings=self.settings
            )  # device resolved (auto: CUDA, MPS, CPU) and probed; [draft] opened
            prepare_vocabulary(
                self.model.tokenizer
            )  # structured output's vocabulary, built while warming up
            s = self.settings
            context = self.model.net.args.max_position_embeddings  # models/contract.py
            self.scheduler = Scheduler(
                self.model.net,
                self.model.eos_token_ids,
                scheduler_limits(s, self.model, context),
                draft=self.model.draft,
                draft_policy=self.model.draft_policy,
            )
            # before the first request
            self.scheduler.core.prefix.disk = files.prompt_disk(s, self.model)
            notify.status("warming up")
            tok = self.model.tokenizer
            first = (tok.encode("Hi") or [tok.bos_token_id or 0])[:1]
            _, fin = collect(
                self.scheduler.submit(GenRequest(tuple(first), SamplingParams(max_new_tokens=1))),
                timeout=600,
            )
            if fin.reason == "error":
                raise DeltafindError(f"warm-up failed: {fin.error}")
            ready = ReadyEngine(
                self.scheduler,
                tok,
                model_name(s),
                context,
                store_snapshot=self.store_snapshot,
                # a cluster's expert nodes: /health says degraded while one is down
                nodes=self.model.cluster.status if self.model.cluster is not None else list,
                drive_problems=lambda: list(self.model.experts.reader.problems.values()),
                aliases=tuple(s.server.model_aliases),
            )
            files.turns_file(self.scheduler, ready, save=False)
            self.state.set_ready(ready)
            log.info(
                "model_ready",
                store=str(store_dir(s)),
                family=self.model.manifest.family,
                load_s=round(time.monotonic() - t0, 2),
                context=context,
            )
            notify.ready(f"serving {model_name(s)}")
            threading.Thread(
                target=self._save_heat_periodically, name="deltafind-heat", daemon=True
            ).start()
        except Exception as e:
            code = e.exit_code if isinstance(e, DeltafindError) and e.exit_code in (3, 4) else 4
            log.error("model_load_failed", error=str(e), exc_info=not isinstance(e, DeltafindError))
            self.state.set_failed(str(e))
            notify.status(f"model load failed: {e}")
            for h in __import__("logging").getLogger().handlers:
                h.flush()
            os._exit(
                code
            )  # gunicorn's arbiter halts on exit code 3 (boot error) or 4 (app load error)

    def _save_heat_periodically(self) -> None:
        while not self._stop.wait(self.settings.cache.heat_save_s):
            try:  # the engine thread hands over its counts; this thread writes them (a full disk never stalls a step)
                self.model.write_heat(self.scheduler.call(self.model.take_uses))  # type: ignore[union-attr]
            except Exception as e:
                log.warning("heat_not_saved", error=str(e))

    def _extend_while_loading(self) -> None:
        while self.state.engine is None and self.state.load_status == "loading":
            notify.extend_timeout(60)
            if self._stop.wait(20):
                return

    def healthy(self) -> bool:
        return self.scheduler is None or self.scheduler.alive

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
                    return {
                        "ok": False,
                        "message": str(e),
                        "applied": [],
                        "restart_needed": self.pending_restart,
                    }
                live, restart = changed_keys(self.settings, new)
                self.settings = self._merge(self.settings, new, live)
                self._apply(self.settings, new_server, live)
                self.pending_restart = sorted(set(restart))
                self.config_loaded_at = time.time()
                log.info("reloaded", applied=live, restart_needed=self.pending_restart)
                msg = "reloaded" + (
                    f"; restart to apply {', '.join(self.pending_restart)}"
                    if self.pending_restart
                    else ""
                )
                return {
                    "ok": True,
                    "message": msg,
                    "applied": live,
                    "restart_needed": self.pending_restart,
                }
            finally:
                notify.ready(f"serving {model_name(self.settings)}")

    @staticmethod
    def _merge(old: Settings, new: Settings, live: list[str]) -> Settings:
        update: dict[str, Any] = {}
        for key in live:
            section, _, sub = key.partition(".")
            base = update.get(section, getattr(old, section))
            update[section] = (
                base.model_copy(update={sub: getattr(getattr(new, section), sub)})
                if sub
                else getattr(new, section)
            )
        return old.model_copy(update=update)

    def _apply(self, new: Settings, new_server: ServerConfig, live: list[str]) -> None:
        self.state.config = (
            new_server  # keys, body limit, max_tokens default, max_context (key file re-read too)
        )
        if "logging.level" in live:
            configure_logging(new.logging.level, new.logging.format)
        sched, model = self.scheduler, self.model
        if sched is None or model is None:
            return
        # the context from the model itself (models/contract.py), also for a reload during warm-up
        sched.configure(scheduler_limits(new, model, model.net.args.max_position_embeddings))
        if any(k.startswith("draft.") for k in live):
            from deltafind.engine.draft.policy import PolicyOptions

            d = new.draft
            sched.configure_draft(
                PolicyOptions(mode="auto" if d.mode == "off" else d.mode, max_width=d.max_width),
                enabled=d.mode != "off",
            )
            if d.mode != "off" and sched.core.draft is None:
                log.warning(
                    "draft_reload_needs_restart",
                    reason="started with [draft] mode = \"off\"; no source is loaded",
                )

        sched.call(lambda: model.apply_live(new, live))

    # -- drain / trace / status ------------------------------------------------

    def drain(self, grace_s: float | None = None) -> None:
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

        threading.Thread(target=cancel_after_grace, name="deltafind-drain", daemon=True).start()

    def resume(self) -> None:
        if self.scheduler is not None:
            self.scheduler.resume()

    def trace(self, start: bool, path: str | None) -> dict[str, Any]:
        if self.scheduler is None or self.model is None:
            raise DeltafindError("the model is still loading; try again when it is ready")
        from deltafind.store.trace import TraceWriter, open_trace_file

        writer = None
        if start:
            folder = files.trace_dir(self.settings)
            name = path or time.strftime("trace-%Y%m%d-%H%M%S.jsonl")
            files.check_trace_path(folder / name, self.settings, self.model, self.config_path)
            fd, full = open_trace_file(folder, name)
            writer = TraceWriter(full, fd=fd)
        experts = self.model.experts

        def swap() -> Any:
            old, experts.trace = experts.trace, writer
            return old

        old = self.scheduler.call(swap)
        if old is not None:
            old.close(wait_s=0)  # its own thread writes what is left
        self._trace = (
            writer or self._trace
        )  # after a stop, status still shows the last trace (and its error)
        written = str(writer.path) if writer else ""
        log.info("trace", active=start, path=written or None)
        return {"active": start, "path": written}

    def status(self) -> dict[str, Any]:
        """The daemon's own figures and the engine's queue (a figure not known yet, while loading, is left to the
        reply's zero), then the engine's and the store's whole snapshots."""
        s = self.settings
        out: dict[str, Any] = {
            "model": model_name(s),
            "version": __version__,
            "pid": os.getpid(),
            "uptime_s": time.time() - self.started_at,
            "ready": self.state.engine is not None,
            "load_status": self.state.load_status,
            "config_path": str(self.config_path or ""),
            "config_loaded_at": self.config_loaded_at,
            "restart_needed": list(self.pending_restart),
            "trace_path": str(self._trace.path)
            if self._trace is not None and self._trace.active
            else "",
        }
        engine: dict[str, Any] = {}
        if self.scheduler is not None:
            engine = self.scheduler.snapshot()
            out.update(
                {
                    k: engine[k]
                    for k in ("running", "waiting", "draining", "max_running", "max_queue")
                }
            )
        out["snapshot_json"] = json.dumps(
            {
                "engine": engine,
                "store": self.store_snapshot(),
                "trace": files.trace_state(self._trace),
            }
        )
        return out

    def store_snapshot(self) -> dict[str, Any]:
        return self.model.snapshot() if self.model is not None else {}

    def close(self) -> None:
        self._stop.set()
        if self.control is not None:
            self.control.stop()
        if self.scheduler is not None:
            self.scheduler.close()
            disk = self.scheduler.core.prefix.disk
            if disk is not None and not disk.flush(30):  # prompt state a restart would reuse
                log.warning("prompt_disk_not_flushed", dir=str(disk.dir))
            files.turns_file(self.scheduler, self.state.engine, save=True)
        if self.model is not None:
            self.model.close()
