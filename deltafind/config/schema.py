"""The settings schema: one frozen model per TOML section, and `Settings`.

Every field carries its description (the example config is generated from
it) and, when `deltafinctl reload` can apply it to a running daemon,
`json_schema_extra={"live": True}`. Reading files lives in `load.py`.
"""

from __future__ import annotations

import os
import re
import sys
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from deltafind.config.types import ByteSize, FileMode

LIVE: dict[str, Any] = {"live": True}
_DEVICE_RE = re.compile(r"auto|cpu|cuda|cuda:\d+|mps")
# sun_path holds 108 bytes on Linux and 104 on macOS, NUL included.
_MAX_SOCKET_PATH = 103 if sys.platform == "darwin" else 107


def is_live(field: FieldInfo) -> bool:
    """Whether `deltafinctl reload` applies this field without a restart."""
    extra = field.json_schema_extra
    return isinstance(extra, dict) and extra.get("live") is True


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSettings(_Section):
    store: Path | None = Field(
        None,
        description="Store folder made by `deltafind setup`: its manifest names the model, "
        "the spine and the expert files. Required to serve.",
        examples=["/var/lib/deltafind/kimi-k3"],
    )
    name: str | None = Field(
        None,
        min_length=1,
        description="Model id served by the API (`model` in requests, /v1/models). "
        "Unset = the store folder's name.",
        examples=["kimi-k3"],
    )


class DriveSettings(_Section):
    path: Path = Field(
        description="Folder on this drive holding the store's expert files.",
        examples=["/mnt/nvme0/deltafind"],
    )
    read_mb_s: float | None = Field(
        None,
        gt=0,
        description="Cap reads from this drive at this many MB/s (10^6 bytes) with a token "
        "bucket, to EMULATE a slower drive in benchmarks and tests. Leave unset in "
        "production: unset = no cap.",
        examples=[2000.0],
    )
    queue_depth: int = Field(
        8, ge=1, le=1024, description="Most reads in flight on this drive at once (1..1024)."
    )


class DeviceSettings(_Section):
    kind: str = Field(
        "auto",
        description="Where the model computes: auto (the best available accelerator, else "
        "cpu), cpu, cuda (GPU 0), cuda:N (GPU N) or mps (Apple GPU).",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="Activation dtype: float32 (matches the reference path) or bfloat16. "
        "Weights keep the format the store holds them in.",
    )
    threads: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="CPU threads for compute (torch intra-op threads). Unset = torch's default.",
        examples=[16],
    )
    compile: bool = Field(
        False,
        description="On a GPU, torch.compile the MXFP4 dequantisation into one fused kernel (same "
        "bits). Off by default: not yet measured to pay; tests/gpu/bench_gpu.py measures it.",
    )

    @field_validator("kind", mode="before")
    @classmethod
    def _check_kind(cls, value: object) -> object:
        if isinstance(value, str) and _DEVICE_RE.fullmatch(value.strip().lower()):
            return value.strip().lower()
        raise ValueError("expected auto, cpu, cuda, cuda:N (N = GPU index) or mps")


class CacheSettings(_Section):
    expert_bytes: ByteSize | None = Field(
        ByteSize("4GiB"),
        description="Memory for routed experts kept between uses (RAM, or GPU memory when "
        "computing on a GPU). More = fewer drive reads.",
        json_schema_extra=LIVE,
    )
    pin_bytes: ByteSize = Field(
        ByteSize(0),
        description="Part of expert_bytes reserved for a pinned tier: the hottest experts (by "
        "heat) stay resident and are never evicted. 0 = no pinned tier.",
        json_schema_extra=LIVE,
    )
    spine_bytes: ByteSize | None = Field(
        None,
        description="Memory for the spine (attention, shared experts, embeddings). Unset = the "
        "whole spine stays resident; a smaller budget streams the rest from the drives.",
        examples=[ByteSize("64GiB")],
    )
    heat_decay: float = Field(
        0.99,
        gt=0,
        le=1,
        description="Per-token decay of each expert's heat score, which orders eviction and "
        "pinning (heat = heat * decay + hits). Closer to 1 = longer memory.",
        json_schema_extra=LIVE,
    )
    heat_save_s: float = Field(
        600.0,
        gt=0,
        description="Seconds between merges of the served model's expert heat into the store's "
        "heat.json (also done at shutdown), so a crash loses at most this much learning.",
    )
    read_mode: Literal["direct", "buffered"] = Field(
        "direct",
        description="How experts are read from the drives. direct: O_DIRECT, bypassing the OS "
        "page cache, so the memory used is what expert_bytes allows and every miss costs a "
        "drive read. buffered: through the page cache, for stores that fit in RAM: a re-read "
        "expert comes from memory, but the kernel holds those bytes outside expert_bytes "
        "(measured trade-off: tests/bench/RESULTS.md). Needs a restart.",
    )
    spine_int8: bool = Field(
        False,
        description="NOT WEIGHT-EXACT, off by default: hold the spine's matrices as row-int8 "
        "(Kimi K3 spec 9.6: per-row f16 scale, int8 weights), about half of bf16, so a model "
        "whose bf16 spine does not fit can stay resident. The logits drift from the released "
        "weights' (tests/bench/RESULTS.md); --stats and status say when it is on.",
    )

    @field_validator("pin_bytes")
    @classmethod
    def _pin_within_budget(cls, value: ByteSize, info: ValidationInfo) -> ByteSize:
        budget = info.data.get("expert_bytes")
        if budget is not None and value > budget:
            raise ValueError(
                f"expected at most cache.expert_bytes ({budget.human()}): the pinned tier is "
                "part of the expert cache"
            )
        return value


class PrefetchSettings(_Section):
    enabled: bool = Field(
        True,
        description="Read experts predicted to be routed soon, so reads overlap compute.",
        json_schema_extra=LIVE,
    )
    max_in_flight: int = Field(
        32,
        ge=1,
        le=4096,
        description="Most prefetch reads outstanding across all drives (1..4096).",
        json_schema_extra=LIVE,
    )
    recall_threshold: float = Field(
        0.3,
        ge=0,
        le=1,
        description="Prefetch an expert when the predicted probability that it is routed is "
        "at least this (0..1). Lower = more reads, fewer misses.",
        json_schema_extra=LIVE,
    )


class DraftSettings(_Section):
    mode: Literal["off", "auto", "on"] = Field(
        "auto",
        description="Speculative decoding: off, on (always; startup fails without a draft "
        "source) or auto (when a draft source is available and it pays off).",
        json_schema_extra=LIVE,
    )
    source: str = Field(
        "auto",
        min_length=1,
        description='Where drafts come from: "auto" (the best available), "self" (the model '
        'drafts for itself), "ngram" (lookup in the context), "dspark" (a DSpark draft '
        "model), the path of a draft model's store sharing the vocabulary, or \"cross:STORE[,WIDE]\" "
        "(a draft with another tokenizer, used for raw completions only, never for chat).",
    )
    max_width: int = Field(
        7,
        ge=1,
        le=16,
        description="Most draft tokens proposed and verified per step (1..16).",
        json_schema_extra=LIVE,
    )


class ServerSettings(_Section):
    host: str = Field(
        "127.0.0.1",
        min_length=1,
        description="Address the HTTP API listens on; 127.0.0.1 keeps it local, 0.0.0.0 "
        "exposes it (set API keys then).",
    )
    port: int = Field(
        8000, ge=0, le=65535, description="TCP port of the HTTP API (0 = pick a free port)."
    )
    unix_socket: Path | None = Field(
        None,
        description="Also serve the HTTP API on this Unix socket. Unset = TCP only.",
        examples=["/run/deltafind/api.sock"],
    )
    api_keys: list[str] = Field(
        [],
        repr=False,
        description="Accepted API keys (`Authorization: Bearer KEY`). With none here or in "
        "api_key_file, requests need no key. Prefer api_key_file or "
        "DELTAFIND_SERVER__API_KEYS to keeping keys in this file.",
        json_schema_extra={"live": True, "secret": True},
    )
    api_key_file: Path | None = Field(
        None,
        description="File of more accepted API keys, one per line (blank lines and # "
        "comments ignored); read again on reload.",
        examples=["/etc/deltafind/api-keys"],
        json_schema_extra=LIVE,
    )
    max_body_bytes: ByteSize = Field(
        ByteSize("1MiB"),
        description="Largest request body accepted; larger ones get 413.",
        json_schema_extra=LIVE,
    )
    max_queue: int = Field(
        64,
        ge=0,
        le=65536,
        description="Most requests waiting for a free slot; more get 429 with Retry-After.",
        json_schema_extra=LIVE,
    )
    max_running: int = Field(
        8, ge=1, le=4096, description="Most sequences generating at once.", json_schema_extra=LIVE
    )
    max_context: int | None = Field(
        None,
        ge=1,
        description="Most tokens per sequence, prompt plus completion. Unset = the model's "
        "context length.",
        examples=[131072],
        json_schema_extra=LIVE,
    )
    max_prefill_tokens: int | None = Field(
        None,
        ge=1,
        description="Most prompt tokens one step runs (a prefill chunk). Unset = as many as "
        "memory allows (derived from the memory free at load, less the caches' budgets). Each "
        "chunk reads each expert it needs once per layer, so larger chunks read fewer bytes per "
        "prompt token; a cap shortens the steps that running sequences wait behind.",
        examples=[4096],
        json_schema_extra=LIVE,
    )
    max_tokens_default: int = Field(
        512,
        ge=1,
        description="Completion length for requests that set no max_tokens.",
        json_schema_extra=LIVE,
    )
    timeout_s: float = Field(
        30.0,
        gt=0,
        description="Seconds a worker may go silent before gunicorn restarts it (gunicorn "
        "`timeout`); the worker heartbeats during long generations.",
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Seconds a client has to send a request's line and headers, from its first "
        "byte (or from the end of the previous answer on a kept-alive connection); slower "
        "clients get 408 and are closed. Heads are gathered without a request thread, so "
        "slow clients never hold one.",
    )
    body_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Seconds a client has to send a request's whole body once its headers are "
        "in; a slower body gets 408.",
    )
    graceful_timeout_s: float = Field(
        30.0,
        ge=0,
        description="Seconds in-flight requests get to finish after SIGTERM (gunicorn "
        "`graceful_timeout`); systemd's TimeoutStopSec must be longer.",
    )

    @field_validator("api_keys")
    @classmethod
    def _check_keys(cls, keys: list[str]) -> list[str]:
        if any(not key or key != key.strip() or " " in key for key in keys):
            raise ValueError("expected non-empty API keys without spaces")
        return keys


class ControlSettings(_Section):
    socket: Path = Field(
        Path("/run/deltafind/control.sock"),
        description="Unix socket of the control API that deltafinctl talks to.",
    )
    mode: FileMode = Field(
        FileMode(0o600),
        description='Permissions of the control socket, octal: "0600" = owner only, "0660" = '
        "owner and group.",
    )
    group: str | None = Field(
        None,
        min_length=1,
        description='Group to own the control socket, so its members can use deltafinctl (with '
        'mode "0660"). Unset = the daemon\'s group.',
        examples=["deltafind"],
    )

    @field_validator("socket")
    @classmethod
    def _check_socket(cls, path: Path) -> Path:
        if len(str(path).encode()) > _MAX_SOCKET_PATH:
            raise ValueError(f"expected a socket path of at most {_MAX_SOCKET_PATH} bytes")
        return path


class LoggingSettings(_Section):
    level: Literal["debug", "info", "warning", "error"] = Field(
        "info",
        description="Least severe level logged: debug, info, warning or error.",
        json_schema_extra=LIVE,
    )
    format: Literal["auto", "json", "console"] = Field(
        "auto",
        description="json (one object per line), console (for people), or auto: console on a "
        "TTY, json otherwise and under systemd or launchd.",
    )

    @field_validator("level", "format", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        return value.strip().lower() if isinstance(value, str) else value


class ClusterSettings(_Section):
    role: Literal["off", "coordinator", "expert"] = Field(
        "off",
        description="Expert parallelism over several machines (deltafind/cluster): off (one "
        "machine), coordinator (holds the spine and serves the API; routed experts run on the "
        "expert nodes), or expert (a node started with `deltafind node`).",
    )
    rank: int | None = Field(
        None,
        ge=0,
        description="This process's rank: 0 is the coordinator, 1..N the expert nodes. "
        "Unset = $RANK (torchrun sets it), else 0.",
        examples=[1],
    )
    world_size: int | None = Field(
        None,
        ge=2,
        description="Processes in the cluster: the coordinator plus N expert nodes. "
        "Unset = $WORLD_SIZE (torchrun sets it).",
        examples=[3],
    )
    coordinator: str | None = Field(
        None,
        description="Host name or address of the coordinator, where the process group meets. "
        "Unset = $MASTER_ADDR, else 127.0.0.1.",
        examples=["10.0.0.1"],
    )
    port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="TCP port on the coordinator where the process group meets. Unset = "
        "$MASTER_PORT, else 29500.",
        examples=[29500],
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto",
        description="torch.distributed backend of the per-layer exchange: auto (today gloo), "
        "gloo, or nccl (not supported yet: refused at start).",
    )
    timeout_s: float = Field(
        30.0,
        gt=0,
        description="A node that has not answered a layer within this many seconds fails the "
        "requests in flight and is marked down (its experts' replicas take over).",
    )
    join_timeout_s: float = Field(
        600.0,
        gt=0,
        description="How long each process waits for the whole group to join at start.",
    )
    hot_replicas: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Fraction of each layer's hottest experts placed on two nodes (0 = one copy "
        "of each, 1 = two copies of every expert), when the store has no placement sidecar.",
    )

    @model_validator(mode="before")
    @classmethod
    def _from_environment(cls, data: Any) -> Any:
        # torchrun and the usual launchers name the group with these variables; a key in the file wins.
        if not isinstance(data, dict) or data.get("role", "off") == "off":
            return data
        env = {"rank": "RANK", "world_size": "WORLD_SIZE", "coordinator": "MASTER_ADDR", "port": "MASTER_PORT"}
        return {**{k: os.environ[v] for k, v in env.items() if os.environ.get(v)}, **{k: v for k, v in data.items() if v is not None}}


# The parsed config file for the `load_settings` call in progress; a context
# variable because pydantic-settings builds its sources from the class alone.
_FILE_DATA: ContextVar[dict[str, Any] | None] = ContextVar("deltafind_config_file", default=None)


class _FileSource(PydanticBaseSettingsSource):
    """The TOML file, already read with tomli by `load_settings`."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return (_FILE_DATA.get() or {}).get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(_FILE_DATA.get() or {})


class Settings(BaseSettings):
    """All of deltafind's settings; build it with `load_settings`."""

    # env_ignore_empty: `DELTAFIND_MODEL__STORE=` in an EnvironmentFile means unset, not ".".
    model_config = SettingsConfigDict(
        env_prefix="DELTAFIND_",
        env_nested_delimiter="__",
        env_ignore_empty=True,
        extra="forbid",
        frozen=True,
    )

    model: ModelSettings = Field(default_factory=ModelSettings, description="The model to serve.")
    drives: list[DriveSettings] = Field(
        [],
        description="Drives holding the store's expert files, one [[drives]] table each. "
        "Without any, deltafind uses the drive paths recorded in the store.",
    )
    device: DeviceSettings = Field(default_factory=DeviceSettings, description="Compute device.")
    cache: CacheSettings = Field(default_factory=CacheSettings, description="Memory budgets.")
    prefetch: PrefetchSettings = Field(
        default_factory=PrefetchSettings, description="Reading experts ahead of need."
    )
    draft: DraftSettings = Field(
        default_factory=DraftSettings, description="Speculative decoding."
    )
    server: ServerSettings = Field(
        default_factory=ServerSettings, description="The OpenAI-compatible HTTP API."
    )
    control: ControlSettings = Field(
        default_factory=ControlSettings, description="The control socket used by deltafinctl."
    )
    logging: LoggingSettings = Field(
        default_factory=LoggingSettings, description="Logs, written to stderr."
    )
    cluster: ClusterSettings = Field(
        default_factory=ClusterSettings,
        description="Serving one model from several machines (expert parallelism).",
    )

    @field_validator("drives")
    @classmethod
    def _distinct_drives(cls, drives: list[DriveSettings]) -> list[DriveSettings]:
        seen: set[Path] = set()
        for drive in drives:
            if drive.path in seen:
                raise ValueError(f"expected each drive once; {str(drive.path)!r} is listed twice")
            seen.add(drive.path)
        return drives

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # First wins: overrides (CLI flags), then DELTAFIND_* variables, then the file.
        return init_settings, env_settings, _FileSource(settings_cls)


def changed_keys(old: Settings, new: Settings) -> tuple[list[str], list[str]]:
    """Dotted keys that differ between two settings: (live, restart-needed)."""
    live: list[str] = []
    restart: list[str] = []
    for name, field in Settings.model_fields.items():
        a, b = getattr(old, name), getattr(new, name)
        if isinstance(a, BaseModel):
            for sub, subfield in type(a).model_fields.items():
                if getattr(a, sub) != getattr(b, sub):
                    (live if is_live(subfield) else restart).append(f"{name}.{sub}")
        elif a != b:
            (live if is_live(field) else restart).append(name)
    return live, restart
