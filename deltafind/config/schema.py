"""The settings schema: one frozen model per TOML section, and `Settings`.

Every field carries its description (the example config is generated from
it) and, when `deltafinctl reload` can apply it to a running daemon,
`json_schema_extra={"live": True}`. Reading files lives in `load.py`.
"""

from __future__ import annotations

import builtins
from collections import Counter
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, Field, ValidationInfo, field_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from deltafind.config.section import DEVICE_RE, LIVE, Section, is_live
from deltafind.config.service_sections import (
    ClusterSettings,
    ControlSettings,
    LoggingSettings,
    ServerSettings,
)
from deltafind.config.types import ByteSize

# Validation context key: the Python API's pin tier may sit beside the LRU, past expert_bytes (compose.py).
PIN_BESIDE_CACHE = "pin_beside_cache"


class ModelSettings(Section):
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


class DriveSettings(Section):
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


class DeviceSettings(Section):
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
    math: Literal["exact", "bf16", "q8"] = Field(
        "exact",
        description="exact: every matmul is exact fp32 on the weights as stored. bf16: NOT "
        "BIT-EXACT, opt-in: on a CPU with AVX512-BF16, matmuls of 16 or more token rows "
        "(prefill chunks, and a step that batches 16+ sequences) round the decoded weights and "
        "the activations to bf16 and use the CPU's bf16 dot products (2-3x the exact kernels' "
        "speed at 64+ rows); smaller steps, so single-stream decode, stay exact. q8: NOT "
        "BIT-EXACT, opt-in: llama.cpp's own arithmetic for GGUF Q4_K, Q5_K, Q6_K and Q8_0 "
        "weights at every row count (decode too): each token's activations quantized to "
        "int8 blocks (Q8_K, Q8_0) and integer dot products with the weights as stored (about "
        "2x the exact one-token kernels); every other weight kind stays exact. The logits "
        "drift from exact fp32 (docs/math-modes.md; tests/bench/RESULTS.md); --stats and "
        "status say when a mode is on.",
    )

    @field_validator("kind", mode="before")
    @classmethod
    def _check_kind(cls, value: object) -> object:
        if isinstance(value, str) and DEVICE_RE.fullmatch(value.strip().lower()):
            return value.strip().lower()
        raise ValueError("expected auto, cpu, cuda, cuda:N (N = GPU index) or mps")


class CacheSettings(Section):
    expert_bytes: ByteSize | None = Field(
        ByteSize("4GiB"),
        description="Memory for experts kept between uses (RAM, or GPU memory when computing "
        "on a GPU). More = fewer drive reads. Dense MLP layers that fit are held whole in it at "
        "start, outside the LRU; routed experts get the rest.",
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
    prompt_bytes: ByteSize = Field(
        ByteSize("256MiB"),
        description="Memory for prompt state kept after a request (attention K/V, Kimi K3's KDA "
        "and conv state), so a later prompt that shares a prefix with it (the next turn, a "
        "retry, another session on the same system prompt) prefills only the rest. 0 = off.",
        json_schema_extra=LIVE,
    )
    prompt_snapshot_tokens: int = Field(
        4096,
        ge=0,
        description="Kimi K3 (recurrent KDA state, which cannot be rewound): keep its state every "
        "this many prompt tokens, so an edit mid-history reuses everything before the last "
        "kept point. Each point costs one state copy (about 465 MB on the released K3, "
        "bounded by prompt_bytes: the earliest go first) and splits a prefill chunk. 0 = only "
        "at a chat's history end and the prompt's last tokens.",
        json_schema_extra=LIVE,
    )
    prompt_disk_bytes: ByteSize = Field(
        ByteSize(0),
        description="Drive space for prompt state written to prompt_disk_dir, reused across "
        "daemon restarts and sessions that share a prefix; least recently used files go "
        "first. Each file is checked on load (model, store, chat template, dtype, checksum) "
        "and dropped when anything changed. 0 = off (writes go to a drive of your choosing). "
        "Needs a restart.",
        examples=[ByteSize("16GiB")],
    )
    prompt_disk_dir: Path | None = Field(
        None,
        description="Where prompt state files go. Unset = prompt-cache/ inside the store. The "
        "directory belongs to one store: files of another model or store are deleted. "
        "Needs a restart.",
        examples=["/mnt/nvme0/deltafind-prompts"],
    )
    spine_int8: bool = Field(
        False,
        description="NOT WEIGHT-EXACT, off by default: hold the spine's matrices as row-int8 "
        "(docs/kimi-k3-drafting-io.md §9.6: per-row f16 scale, int8 weights), about half of bf16, so a model "
        "whose bf16 spine does not fit can stay resident. The logits drift from the released "
        "weights' (tests/bench/RESULTS.md); --stats and status say when it is on.",
    )

    @field_validator("pin_bytes")
    @classmethod
    def _pin_within_budget(cls, value: ByteSize, info: ValidationInfo) -> ByteSize:
        budget = info.data.get("expert_bytes")
        if budget is not None and value > budget and not (info.context or {}).get(PIN_BESIDE_CACHE):
            raise ValueError(
                f"expected at most cache.expert_bytes ({budget.human()}): the pinned tier is "
                "part of the expert cache"
            )
        return value


class PrefetchSettings(Section):
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


class DraftSettings(Section):
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
    draft: DraftSettings = Field(default_factory=DraftSettings, description="Speculative decoding.")
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


# A section set from one value names that setting after the section (docs/configuration.md).
SECTION_FORMS = {"device": ("kind",), "prefetch": ("enabled",), "draft": ("mode", "source")}


def python_names() -> dict[str, tuple[str, str]]:
    """Each setting's Python name (a Model.open keyword; `--the-name` on the command line) ->
    (section, key): its key, or `section_key` where another section has that key or the key is a
    Python builtin (docs/configuration.md). A section form's keys go by the section's name."""
    keys = {
        section: list(
            (get_args(f.annotation) or (f.annotation,))[0].model_fields
        )  # [[drives]]: a list
        for section, f in Settings.model_fields.items()
    }
    counts = Counter(k for ks in keys.values() for k in ks)
    return {
        k if counts[k] == 1 and not hasattr(builtins, k) else f"{section}_{k}": (section, k)
        for section, ks in keys.items()
        for k in ks
        if k not in SECTION_FORMS.get(section, ())
    }


def by_section(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Settings given by Python name (flags, Model.open keywords) as nested `{section: {key: value}}`."""
    names = python_names()
    nested: dict[str, dict[str, Any]] = {}
    for name, value in values.items():
        section, key = names[name]
        nested.setdefault(section, {})[key] = value
    return nested
