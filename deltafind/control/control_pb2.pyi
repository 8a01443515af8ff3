from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Drive(_message.Message):
    __slots__ = ("index", "path", "healthy", "reads", "bytes_read", "read_gb_s")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    READS_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    READ_GB_S_FIELD_NUMBER: _ClassVar[int]
    index: int
    path: str
    healthy: bool
    reads: int
    bytes_read: int
    read_gb_s: float
    def __init__(self, index: _Optional[int] = ..., path: _Optional[str] = ..., healthy: _Optional[bool] = ..., reads: _Optional[int] = ..., bytes_read: _Optional[int] = ..., read_gb_s: _Optional[float] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("model", "version", "pid", "uptime_s", "ready", "load_status", "draining", "running", "waiting", "max_running", "max_queue", "tok_s", "steps", "generated_tokens", "prefix_hits", "cache_requested", "cache_hits", "pinned_hits", "cache_hit_rate", "cache_used_bytes", "cache_budget_bytes", "pinned_bytes", "experts_read", "bytes_read", "prefetch_issued", "prefetch_used", "prefetch_wasted", "prefetch_recall", "drives", "config_path", "config_loaded_at", "restart_needed", "trace_path", "draft_source", "draft_mode", "draft_proposed", "draft_accepted", "draft_acceptance_rate", "draft_verify_passes", "draft_saved_s", "draft_failures", "snapshot_json", "store_bytes_present", "store_bytes_total")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    LOAD_STATUS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_FIELD_NUMBER: _ClassVar[int]
    TOK_S_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HITS_FIELD_NUMBER: _ClassVar[int]
    CACHE_REQUESTED_FIELD_NUMBER: _ClassVar[int]
    CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    PINNED_HITS_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    CACHE_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHE_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    PINNED_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_READ_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_ISSUED_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_USED_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_WASTED_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_RECALL_FIELD_NUMBER: _ClassVar[int]
    DRIVES_FIELD_NUMBER: _ClassVar[int]
    CONFIG_PATH_FIELD_NUMBER: _ClassVar[int]
    CONFIG_LOADED_AT_FIELD_NUMBER: _ClassVar[int]
    RESTART_NEEDED_FIELD_NUMBER: _ClassVar[int]
    TRACE_PATH_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SOURCE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROPOSED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_VERIFY_PASSES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SAVED_S_FIELD_NUMBER: _ClassVar[int]
    DRAFT_FAILURES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_JSON_FIELD_NUMBER: _ClassVar[int]
    STORE_BYTES_PRESENT_FIELD_NUMBER: _ClassVar[int]
    STORE_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: str
    pid: int
    uptime_s: float
    ready: bool
    load_status: str
    draining: bool
    running: int
    waiting: int
    max_running: int
    max_queue: int
    tok_s: float
    steps: int
    generated_tokens: int
    prefix_hits: int
    cache_requested: int
    cache_hits: int
    pinned_hits: int
    cache_hit_rate: float
    cache_used_bytes: int
    cache_budget_bytes: int
    pinned_bytes: int
    experts_read: int
    bytes_read: int
    prefetch_issued: int
    prefetch_used: int
    prefetch_wasted: int
    prefetch_recall: float
    drives: _containers.RepeatedCompositeFieldContainer[Drive]
    config_path: str
    config_loaded_at: float
    restart_needed: _containers.RepeatedScalarFieldContainer[str]
    trace_path: str
    draft_source: str
    draft_mode: str
    draft_proposed: int
    draft_accepted: int
    draft_acceptance_rate: float
    draft_verify_passes: int
    draft_saved_s: float
    draft_failures: int
    snapshot_json: str
    store_bytes_present: int
    store_bytes_total: int
    def __init__(self, model: _Optional[str] = ..., version: _Optional[str] = ..., pid: _Optional[int] = ..., uptime_s: _Optional[float] = ..., ready: _Optional[bool] = ..., load_status: _Optional[str] = ..., draining: _Optional[bool] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., max_running: _Optional[int] = ..., max_queue: _Optional[int] = ..., tok_s: _Optional[float] = ..., steps: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., prefix_hits: _Optional[int] = ..., cache_requested: _Optional[int] = ..., cache_hits: _Optional[int] = ..., pinned_hits: _Optional[int] = ..., cache_hit_rate: _Optional[float] = ..., cache_used_bytes: _Optional[int] = ..., cache_budget_bytes: _Optional[int] = ..., pinned_bytes: _Optional[int] = ..., experts_read: _Optional[int] = ..., bytes_read: _Optional[int] = ..., prefetch_issued: _Optional[int] = ..., prefetch_used: _Optional[int] = ..., prefetch_wasted: _Optional[int] = ..., prefetch_recall: _Optional[float] = ..., drives: _Optional[_Iterable[_Union[Drive, _Mapping]]] = ..., config_path: _Optional[str] = ..., config_loaded_at: _Optional[float] = ..., restart_needed: _Optional[_Iterable[str]] = ..., trace_path: _Optional[str] = ..., draft_source: _Optional[str] = ..., draft_mode: _Optional[str] = ..., draft_proposed: _Optional[int] = ..., draft_accepted: _Optional[int] = ..., draft_acceptance_rate: _Optional[float] = ..., draft_verify_passes: _Optional[int] = ..., draft_saved_s: _Optional[float] = ..., draft_failures: _Optional[int] = ..., snapshot_json: _Optional[str] = ..., store_bytes_present: _Optional[int] = ..., store_bytes_total: _Optional[int] = ...) -> None: ...

class ReloadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReloadReply(_message.Message):
    __slots__ = ("ok", "message", "applied", "restart_needed")
    OK_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    RESTART_NEEDED_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    message: str
    applied: _containers.RepeatedScalarFieldContainer[str]
    restart_needed: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, ok: _Optional[bool] = ..., message: _Optional[str] = ..., applied: _Optional[_Iterable[str]] = ..., restart_needed: _Optional[_Iterable[str]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("grace_s",)
    GRACE_S_FIELD_NUMBER: _ClassVar[int]
    grace_s: float
    def __init__(self, grace_s: _Optional[float] = ...) -> None: ...

class ResumeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TraceRequest(_message.Message):
    __slots__ = ("action", "path")
    class Action(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        START: _ClassVar[TraceRequest.Action]
        STOP: _ClassVar[TraceRequest.Action]
    START: TraceRequest.Action
    STOP: TraceRequest.Action
    ACTION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    action: TraceRequest.Action
    path: str
    def __init__(self, action: _Optional[_Union[TraceRequest.Action, str]] = ..., path: _Optional[str] = ...) -> None: ...

class TraceReply(_message.Message):
    __slots__ = ("active", "path")
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    active: bool
    path: str
    def __init__(self, active: _Optional[bool] = ..., path: _Optional[str] = ...) -> None: ...
