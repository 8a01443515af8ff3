"""The composition root: settings become the objects that run a model, for every entry point.

`settings_with` turns Model.open's keywords into one `Settings` (each setting by its Python
name, docs/configuration.md); `make_model` builds device, store, family, spine and experts from it; `server_config` and
`scheduler_limits` build the daemon's server and engine parts. api.Model, `run`/`bench`
and the daemon's runtime all come through here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from deltafind.config import CacheSettings, DraftSettings, Settings, load_settings
from deltafind.config.schema import PIN_BESIDE_CACHE, python_names
from deltafind.device.device_cache import DeviceExpertCache
from deltafind.device.device_cache import spine_budget as device_spine_budget
from deltafind.device.select import START_ERRORS as DEVICE_START_ERRORS
from deltafind.device.select import DeviceError, start_device
from deltafind.device.select import release as release_device
from deltafind.device.staging import make_stager, read_buffer_pool
from deltafind.engine.prefill import activation_budget, plan_for
from deltafind.engine.scheduler import SchedulerLimits
from deltafind.errors import ConfigError, StoreError
from deltafind.log import get_logger
from deltafind.models.ops import fast_math
from deltafind.models.ops.cpu_kernels import missing_note
from deltafind.models.ops.moe import SlicedMLP
from deltafind.models.ops.mxfp4 import use_compile
from deltafind.models.ops.stored import (
    adopt_stored,
    hold_dtype,
    install_quantized,
    int8_spine,
    stored_weight_names,
)
from deltafind.models.registry import family_module
from deltafind.store.experts import StoreExperts
from deltafind.store.heat import hottest, read_heat
from deltafind.store.huge_pages import move_to_huge_pages
from deltafind.store.manifest import SPINE_NAME, TOKENIZER_DIR, Manifest
from deltafind.store.spine import SpineStreamer, load_resident, plan_spine, read_layout
from deltafind.store.trace import TraceWriter
from deltafind.tokenizer import Tokenizer

log = get_logger(__name__)


def draft_settings(spec: str, max_width: int | None = None) -> DraftSettings:
    """A `--draft` value as `[draft]`: off; auto (draft while it pays); any named source, forced on."""
    mode = spec if spec in ("off", "auto") else "on"
    fields = {"mode": mode, "source": "auto" if mode == "off" else spec}
    return DraftSettings(**fields, **({"max_width": max_width} if max_width else {}))


def settings_with(
    settings: Settings | None, store: str | Path | None, overrides: dict[str, Any]
) -> Settings:
    """`settings` (default: `load_settings()` with drafting off) with Model.open's keywords on top:
    each setting by its Python name (config.python_names), and the section forms device, prefetch,
    drives and draft (docs/configuration.md)."""
    names = {k: v for k, v in python_names().items() if v[0] != "drives"}
    names.update(device=("device", "kind"), prefetch=("prefetch", "enabled"))  # section forms
    nested: dict[str, dict[str, Any]] = {"model": {"store": store}} if store else {}
    for key, value in overrides.items():
        if key == "prefetch" and not isinstance(value, bool):
            raise TypeError(
                f"Model.open(prefetch=) takes True or False, not {type(value).__name__}; "
                "pass max_in_flight= and recall_threshold= by name"
            )
        if key == "drives":
            nested["drives"] = value  # type: ignore[assignment]  # DriveOptions, resolved below
        elif key == "draft":
            nested.setdefault("draft", {}).update(
                draft_settings(value).model_dump(include={"mode", "source"})
            )
        elif key in names:
            section, name = names[key]
            nested.setdefault(section, {})[name] = value
        else:
            raise TypeError(
                f"Model.open() got an unexpected keyword {key!r}: pass a setting by its Python name "
                "(docs/configuration.md: its key, or section_key), device, prefetch, drives, draft, "
                "or settings="
            )
    if settings is None:
        nested.setdefault("draft", {}).setdefault("mode", "off")  # the Python API drafts when asked
    data = (settings or load_settings()).model_dump()
    for section, values in nested.items():
        data[section] = values if section == "drives" else {**data[section], **values}
    if data["model"]["store"] is None:
        raise StoreError("no store to open: pass its folder, or set [model] store")
    store = data["model"]["store"] = Path(data["model"]["store"]).expanduser()
    if "drives" in nested:
        paths = Manifest.load(store).drive_paths(store)
        data["drives"] = [
            {"path": d.path or paths[i], "queue_depth": d.queue_depth, "read_mb_s": d.read_mb_s}
            for i, d in enumerate(nested["drives"])
        ]  # type: ignore[arg-type]
    # The API may pin past the LRU's budget (the pin tier sits beside it): PIN_BESIDE_CACHE.
    try:
        cache = CacheSettings.model_validate(data["cache"], context={PIN_BESIDE_CACHE: True})
        return Settings.model_validate({**data, "cache": cache})
    except ValidationError as e:
        raise ConfigError(f"Model.open: {e}") from None


def make_model(
    handle: Callable[..., Any], settings: Settings, trace_path: str | Path | None = None
) -> Any:
    """`handle` (api.Model) opened as `settings` say; a device that fails at start falls back to the CPU (logged)."""
    if settings.device.threads:
        torch.set_num_threads(settings.device.threads)
    device = start_device(
        settings.device.kind
    )  # auto picks CUDA, then MPS, then CPU; an unusable one gives the CPU
    try:
        model = load_model(handle, settings, device, trace_path)
    except DEVICE_START_ERRORS as e:
        if device.type == "cpu":
            raise
        log.error(
            "device_failed_at_start",
            device=str(device),
            error=f"{type(e).__name__}: {e}",
            fallback="cpu",
        )
        release_device(device)
        model = load_model(handle, settings, torch.device("cpu"), trace_path)
    try:
        model.open_draft(settings.draft)
    except BaseException:
        model.close()
        raise
    return model


def load_model(
    handle: Callable[..., Any],
    settings: Settings,
    device: torch.device,
    trace_path: str | Path | None,
) -> Any:
    """`handle(...)` (api.Model) holding what `settings` describe on `device`: store, family, spine, experts."""
    from safetensors import safe_open

    store_dir = Path(settings.model.store).expanduser()  # type: ignore[arg-type]
    manifest = Manifest.load(store_dir)
    torch_dtype = getattr(torch, settings.device.dtype)  # a [device] dtype is torch's name
    family = family_module(manifest.family)
    args = family.ModelArgs.from_config(manifest.model_config)
    c = settings.cache
    expert_bytes = None if c.expert_bytes is None else int(c.expert_bytes)
    trace = TraceWriter(Path(trace_path)) if trace_path else None
    cache = DeviceExpertCache(device, expert_bytes) if device.type != "cpu" else None
    # bf16/fp16 experts stay as stored in the cache (twice the experts per byte) and are computed on as stored
    hold = hold_dtype(
        {getattr(torch, t.dtype) for r in manifest.experts for t in r.tensors}, torch_dtype
    )
    experts = StoreExperts.from_settings(
        settings,
        manifest,
        store_dir,
        hold,
        trace,
        stager=make_stager(device),
        cache=cache,
        buffer_pool=read_buffer_pool(device),
    )
    if int(c.pin_bytes):
        experts.resident.pin(hottest(read_heat(store_dir)), int(c.pin_bytes))
    provider = experts
    # routed experts run on the expert nodes (deltafind/cluster)
    if settings.cluster.role == "coordinator":
        from deltafind.cluster.coordinator import ClusterExperts
        from deltafind.cluster.wire import group_spec

        provider = ClusterExperts(
            experts, group_spec(settings.cluster), store_dir, settings.cluster.hot_replicas
        )
    with torch.device("meta"):
        net = family.Model(args, provider)
    # Routing biases stay fp32 (as in HF: rounding them can flip expert choices); see store/spine.py.
    spine_path = store_dir / SPINE_NAME
    spine_bytes = None if c.spine_bytes is None else int(c.spine_bytes)
    budget = device_spine_budget(
        device, spine_bytes
    )  # on a GPU: capped by its free memory, same prefix rule
    try:
        layout = read_layout(spine_path, torch_dtype, keep=stored_weight_names(net))
        plan = plan_spine(layout, net.num_layers, budget)
    except StoreError as e:
        if budget == spine_bytes:
            raise
        raise DeviceError(
            f"{device} has too little free memory for the spine's always-resident part: {e}"
        ) from e
    with safe_open(str(spine_path), "pt", device="cpu") as f:
        spine = load_resident(spine_path, plan, device, f.get_tensor)
    streamed = {t.name for i in plan.streamed for t in plan.layers[i]}
    tied = args.tie_word_embeddings
    if tied:
        spine.pop("lm_head.weight", None)
    quants = {
        t.name: t.quant for t in layout if t.quant
    }  # GGUF blocks stay blocks (models/ops/stored.py)
    install_quantized(net, quants, {n: spine.pop(n) for n in list(spine) if n in quants})
    missing, unexpected = net.load_state_dict(spine, strict=False, assign=True)
    del spine  # the parameters hold the tensors now: each frees as it moves to huge pages (below)
    missing = [
        k
        for k in missing
        if not (tied and k == "lm_head.weight") and k not in streamed and k not in quants
    ]
    if missing or unexpected:
        raise StoreError(
            f"{store_dir}: spine does not fit the {manifest.family} model (missing {missing[:5]}, unexpected {unexpected[:5]}); re-import the store"
        )
    if tied:
        net.tie_weights()
    adopt_stored(net, torch_dtype)  # bf16/fp16 matmul weights stay as stored; fp32 activations
    if device.type == "cpu" and (note := missing_note()):
        log.warning("cpu_kernels_missing", note=note)
    if fast_math.use(settings.device.math) != settings.device.math:
        log.warning("math_exact", note=fast_math.unavailable_note(settings.device.math))
    elif settings.device.math != "exact":
        log.warning(f"math_{settings.device.math}", note=fast_math.describe(settings.device.math))
    if c.spine_int8:
        log.warning(
            "spine_int8",
            saved_bytes=int8_spine(net),
            note="row-int8 spine: NOT weight-exact ([cache] spine_int8)",
        )
    net.eval()
    if cache is not None:
        # device memory: capped by what is free now that the spine is placed
        cache.resize(expert_bytes)
        if settings.device.compile:
            use_compile(True)
            log.info("mxfp4_compile", device=str(device))
    # Dense MLPs held whole within the expert budget, outside the LRU (store/resident.py); the LRU keeps the rest.
    experts.hold_dense([m.layer_idx for m in net.modules() if isinstance(m, SlicedMLP)])
    # Before any forward plans a kernel call on their addresses (store/huge_pages.py)
    move_to_huge_pages([*net.parameters(), *net.buffers()], "spine")
    move_to_huge_pages(experts.resident.tensors(), "held_experts")
    model = handle(
        store_dir, manifest, net, experts, Tokenizer.load(store_dir / TOKENIZER_DIR), settings
    )
    if provider is not experts:
        model.cluster = provider
        try:
            provider.start(net)  # joins the group: blocks until every expert node is up
        except BaseException:
            model.close()
            raise
    if plan.streamed:
        model.spine = SpineStreamer(spine_path, plan, device)
        model.spine.bind(net)
        experts.spine = model.spine
        log.info(
            "spine_prefix_resident",
            resident_layers=plan.resident_layers,
            streamed_layers=len(plan.streamed),
            resident_bytes=plan.resident_bytes,
            window_bytes=plan.window_bytes,
            budget_bytes=spine_bytes,
        )
    model.memory_lock.lock(
        [*net.parameters(), *net.buffers()]
    )  # what is held now (int8 rows replaced their bf16)
    # Prefill chunks as large as the memory left once the expert cache has filled its budget allows.
    unfilled = (
        max(experts.cache.budget_bytes - experts.cache.used_bytes, 0)
        if experts.cache.budget_bytes is not None
        else 0
    )
    model.prefill = plan_for(
        args,
        activation_budget(device, unfilled),
        settings.server.max_prefill_tokens,
        torch_dtype.itemsize,
    )
    return model


def store_dir(settings: Settings) -> Path:
    if settings.model.store is None:
        raise StoreError(
            "no store to serve: set [model] store in the config or pass --store DIR "
            "(`deltafind setup --demo` makes a demo store)"
        )
    return Path(settings.model.store).expanduser()


def model_name(settings: Settings) -> str:
    return settings.model.name or store_dir(settings).name


def server_config(settings: Settings) -> Any:
    """`[server]`'s live part as the app reads it (the key file read now: a reload reads it again).
    Imported here, so that the Python API never loads the HTTP server."""
    from deltafind.server import ServerConfig

    s, keys = settings.server, list(settings.server.api_keys)
    try:
        lines = Path(s.api_key_file).read_text().splitlines() if s.api_key_file is not None else []
    except OSError as e:
        raise ConfigError(
            f"{s.api_key_file}: cannot read server.api_key_file: {e.strerror or e}"
        ) from None
    keys += [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    return ServerConfig(
        tuple(dict.fromkeys(keys)),
        int(s.max_body_bytes),
        s.max_tokens_default,
        s.max_context,
        s.temperature_default,
        s.top_p_default,
        s.top_k_default,
    )


def scheduler_limits(s: Settings, model: Any, context: int) -> SchedulerLimits:
    """`[server]` and `[cache]` as the engine's limits for `model` (None: not loaded yet) with `context` tokens."""
    max_context = min(s.server.max_context or context, context)
    cap = (
        s.server.max_prefill_tokens
    )  # else prefill chunks are as large as memory allows (engine/prefill.py)
    prefill = replace(model.prefill, cap=cap) if model is not None else None
    return SchedulerLimits(
        s.server.max_running,
        s.server.max_queue,
        max(cap or max_context, s.server.max_running),
        max_context,
        int(s.cache.prompt_bytes),
        prefill,
        s.cache.prompt_snapshot_tokens,
        step_target_s=s.server.step_target_s or None,
    )
