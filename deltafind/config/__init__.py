"""Settings: the schema, loading it from TOML + DELTAFIND_* variables + overrides, and
the generated example config.

Build `Settings` once (cli/daemon) with `load_settings` and hand each part its
section. Only this package reads the config file or DELTAFIND_* variables.
"""

from deltafind.config.example import render_example_toml
from deltafind.config.load import DEFAULT_CONFIG_PATH, config_path, load_settings
from deltafind.config.schema import (
    CacheSettings,
    ClusterSettings,
    ControlSettings,
    DeviceSettings,
    DraftSettings,
    DriveSettings,
    LoggingSettings,
    ModelSettings,
    PrefetchSettings,
    ServerSettings,
    Settings,
    changed_keys,
    is_live,
)
from deltafind.config.types import ByteSize, FileMode

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "ByteSize",
    "CacheSettings",
    "ClusterSettings",
    "ControlSettings",
    "DeviceSettings",
    "DraftSettings",
    "DriveSettings",
    "FileMode",
    "LoggingSettings",
    "ModelSettings",
    "PrefetchSettings",
    "ServerSettings",
    "Settings",
    "changed_keys",
    "config_path",
    "is_live",
    "load_settings",
    "render_example_toml",
]
