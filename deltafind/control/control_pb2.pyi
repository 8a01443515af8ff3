from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("model", "version", "pid", "uptime_s", "ready", "load_status", "draining", "running", "waiting", "max_running", "max_queue", "config_path", "config_loaded_at", "restart_needed", "trace_path", "snapshot_json")
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
    CONFIG_PATH_FIELD_NUMBER: _ClassVar[int]
    CONFIG_LOADED_AT_FIELD_NUMBER: _ClassVar[int]
    RESTART_NEEDED_FIELD_NUMBER: _ClassVar[int]
    TRACE_PATH_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_JSON_FIELD_NUMBER: _ClassVar[int]
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
    config_path: str
    config_loaded_at: float
    restart_needed: _containers.RepeatedScalarFieldContainer[str]
    trace_path: str
    snapshot_json: str
    def __init__(self, model: _Optional[str] = ..., version: _Optional[str] = ..., pid: _Optional[int] = ..., uptime_s: _Optional[float] = ..., ready: _Optional[bool] = ..., load_status: _Optional[str] = ..., draining: _Optional[bool] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., max_running: _Optional[int] = ..., max_queue: _Optional[int] = ..., config_path: _Optional[str] = ..., config_loaded_at: _Optional[float] = ..., restart_needed: _Optional[_Iterable[str]] = ..., trace_path: _Optional[str] = ..., snapshot_json: _Optional[str] = ...) -> None: ...

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
