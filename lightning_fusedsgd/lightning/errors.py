"""The error that is the user's to fix in a configuration, reported without a traceback by train.py."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration or data problem the user can fix; ``train.py`` prints only its message."""
