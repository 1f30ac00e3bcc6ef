"""What can be wrong with a checkpoint: each error names the file (or state dict) and the fix."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint file cannot be used: missing, unreadable, truncated, corrupted or of unknown layout."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """A checkpoint does not fit the model or optimizer it is loaded into (parameter names or shapes)."""


class InvalidOptimizerStateError(CheckpointError, ValueError):
    """An optimizer state dict is malformed: not a dict, missing keys, or values that cannot be state."""
