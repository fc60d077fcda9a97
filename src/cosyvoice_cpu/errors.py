"""Project error types: every message names the problem and the fix."""

from __future__ import annotations


class CosyVoiceCpuError(Exception):
    """Base class for errors raised by cosyvoice-cpu with a user-facing message."""


class ModelDirError(CosyVoiceCpuError):
    """A model directory is missing a file, holds a corrupt one, or is of an unknown family."""


class ConfigError(CosyVoiceCpuError, ValueError):
    """A configuration value is out of range or inconsistent."""


class WorkCancelled(CosyVoiceCpuError):
    """Work stopped because its caller cancelled it (a client that went away or said stop): not a bad request,
    so a server counts it as cancelled rather than answering 400."""


class MissingExtraError(CosyVoiceCpuError, ImportError):
    """An optional dependency group (``[export]``, ``[server]``) is not installed."""


class ExportError(ModelDirError):
    """An export failed: a bad source directory or target, too little disk, or a graph failed its numerics gate."""


def need(ok: bool, name: str, value: object, rule: str) -> None:
    """Raise ConfigError ``"<name> = <value> is out of range: <rule>"`` unless ``ok``: the one-line check every
    validated configuration uses."""
    if not ok:
        raise ConfigError(f"{name} = {value!r} is out of range: {rule}")
