"""The refusals of config values that every node of the runner shares: a count below its least, a boolean
option given something else (a config's ``no`` or ``'false'`` is a string, which Python takes as true)."""

from __future__ import annotations

from typing import Any

from lightning_fusedsgd.lightning import ConfigError

__all__ = ["check_at_least", "check_flags"]


def check_at_least(key: str, value: int, least: int, meaning: str = "") -> None:
    """Refuses ``data.<key>=value`` below ``least`` (``meaning``: what the setting is, for the message)."""
    if value < least:
        raise ConfigError(f"data.{key}={value} must be >= {least}{meaning}")


def check_flags(node: str, **flags: Any) -> None:
    """Refuses each ``<node>.<key>=value`` of ``flags`` that is no bool."""
    for key, value in flags.items():
        if not isinstance(value, bool):
            raise ConfigError(
                f"{node}.{key}={value!r} is not a boolean: set {node}.{key}=true or {node}.{key}=false"
            )
