"""Error types shared by every layer of deltafind.

Each error names its cause and the fix. Entry points (cli, daemon) map them to
exit codes; the server maps them to OpenAI-shaped responses.
"""

from __future__ import annotations


class DeltafindError(Exception):
    """Base class: a condition the user can act on, with a message saying how."""

    exit_code = 1


class ConfigError(DeltafindError):
    """A config file, key or value is invalid."""

    exit_code = 2


class StoreError(DeltafindError):
    """A store is missing, different from what was asked, or corrupt."""

    exit_code = 3


class CorruptExpertError(StoreError):
    """An expert record failed its checksum or could not be read."""


class UnsupportedModelError(DeltafindError):
    """A checkpoint's family or layout is not one deltafind can run."""

    exit_code = 3


class RequestError(DeltafindError):
    """A generation request has an invalid parameter."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
