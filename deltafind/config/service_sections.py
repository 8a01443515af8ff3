"""The daemon's settings sections: [server] (the HTTP API), [control] (deltafinctl's socket),
[logging] and [cluster] (expert parallelism). The engine's sections and `Settings` are in schema.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from deltafind.config.section import LIVE, MAX_SOCKET_PATH, Section
from deltafind.config.types import ByteSize, FileMode


class ServerSettings(Section):
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
    step_target_s: float = Field(
        0.5,
        ge=0,
        le=3600,
        description="Wall time a step that prefills aims at, so running streams keep emitting while a "
        "long prompt arrives: the prompt is prefilled over several steps, each as many tokens as fit "
        "this time by the costs measured on earlier steps (a step's fixed part, from decode steps: "
        "every layer's pass and its expert reads; and what each prompt token adds), but never fewer "
        "than take as long as that fixed part, so chunks at most double the prefill's cost per token. "
        "0 = no target: one prompt per step, as max_prefill_tokens and memory allow.",
        json_schema_extra=LIVE,
    )
    max_tokens_default: int | None = Field(
        None,
        ge=1,
        description="Most completion tokens for a request that sets no max_tokens (max_output_tokens, "
        "max_completion_tokens). Unset = the rest of the context, as the reference APIs do (agents "
        "such as the Codex CLI send no limit and expect a whole answer).",
        examples=[4096],
        json_schema_extra=LIVE,
    )
    temperature_default: float | None = Field(
        None,
        ge=0.0,
        le=2.0,
        description="Temperature for a request that sets none. Unset = the model's "
        "generation_config.json value, else 1.0 as the reference APIs. Agents such as the Codex "
        "CLI and Claude Code send no temperature; 0 makes their answers greedy.",
        examples=[0.6],
        json_schema_extra=LIVE,
    )
    top_p_default: float | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="top_p for a request that sets none. Unset = the model's "
        "generation_config.json value, else 1.0.",
        examples=[0.95],
        json_schema_extra=LIVE,
    )
    top_k_default: int | None = Field(
        None,
        ge=0,
        description="top_k for a request that sets none (0 = off). Unset = the model's "
        "generation_config.json value, else off.",
        examples=[20],
        json_schema_extra=LIVE,
    )
    model_aliases: list[str] = Field(
        [],
        description="Other names the served model answers to (listed by /v1/models), e.g. the "
        "model name a client is configured with.",
        examples=[["gpt-5.2-codex", "claude-sonnet-4-5"]],
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


class ControlSettings(Section):
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
    trace_dir: Path | None = Field(
        None,
        description="Folder `deltafinctl trace start NAME` writes router traces in (each a new file; a "
        "path elsewhere, an existing file, a link or a FIFO is refused). Unset = traces/ beside the "
        "control socket; point it at a disk for long traces (each is capped at 256 MiB).",
        examples=["/var/lib/deltafind/traces"],
    )

    @field_validator("socket")
    @classmethod
    def _check_socket(cls, path: Path) -> Path:
        if len(str(path).encode()) > MAX_SOCKET_PATH:
            raise ValueError(f"expected a socket path of at most {MAX_SOCKET_PATH} bytes")
        return path


class LoggingSettings(Section):
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


class ClusterSettings(Section):
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
        env = {
            "rank": "RANK",
            "world_size": "WORLD_SIZE",
            "coordinator": "MASTER_ADDR",
            "port": "MASTER_PORT",
        }
        return {
            **{k: os.environ[v] for k, v in env.items() if os.environ.get(v)},
            **{k: v for k, v in data.items() if v is not None},
        }
