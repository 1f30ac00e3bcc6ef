"""The packages whose classes and functions the runner's configs may name as ``_target_``: Hydra 1.4's
execution whitelist. Hydra 1.4 warns (and 1.5 will refuse) where ``instantiate`` resolves a ``_target_`` that
no whitelist of the trusted calling code allows; Hydra 1.3 has no whitelist, only a blocklist of dangerous
targets."""

from __future__ import annotations

import contextlib
from typing import Any

__all__ = ["TRUSTED_TARGETS", "trusted_targets"]

# conf/ and recipes/ name these, as do the options a user adds (a Lightning callback, logger or plugin).
# Another package's target needs its prefix here under Hydra 1.4.
TRUSTED_TARGETS = ("lightning_fusedsgd.*", "runner.*", "lightning.pytorch.*", "lightly.transforms.*")


def trusted_targets() -> contextlib.AbstractContextManager[Any]:
    """Hydra's ``execution_whitelist(TRUSTED_TARGETS)`` where the installed Hydra has one (1.4, as of
    1.4.0rc3): every ``instantiate`` inside it, Hydra's own included, resolves these targets without a
    warning. Nothing on Hydra 1.3."""
    try:
        from hydra.utils import execution_whitelist
    except ImportError:  # Hydra 1.3
        return contextlib.nullcontext()
    return execution_whitelist(list(TRUSTED_TARGETS))
