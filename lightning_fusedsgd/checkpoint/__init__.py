"""Checkpoints that keep momentum, master weights and the schedule: read, validate, remap, write.

Plain PyTorch (the Lightning glue is in :mod:`lightning_fusedsgd.lightning.checkpointing`). One module per
job (``files``: reading, writing and validation; ``archive``: the zip archive as torch.load reads it;
``remap``: by name; ``foreign``: other runs' and torchvision's checkpoints), each usable on its own:

* **Read safely.** :func:`read_checkpoint_file` checks the archive as ``torch.load`` will read it
  (``archive``: every record whole, regular, stored and of the CRC-32 it was written with, every storage of
  the size its tensors need; ``torch.load`` checks no CRC and trusts the zip directory, so one flipped bit
  can load silently) and turns every failure into a :class:`CheckpointError` that names the file.
* **Remap optimizer state by name.** :func:`remap_optimizer_state_dict` moves per-parameter state
  (momentum buffers, master weights, every slot) from a saved grouping to another, e.g. a one-group
  ``torch.optim.SGD`` checkpoint into a FusedSGD with decay / no-decay groups. Tensors are moved, not
  recomputed, so buffers stay bit-identical.
* **Start a run from a foreign checkpoint.** :func:`read_start_checkpoint` reads a Lightning, a
  torchvision-reference (``{"model", "optimizer", "lr_scheduler", "epoch", "args"}``) or a plain
  weights file and validates it against a module before anything changes; :func:`load_optimizer_state`
  and :func:`seed_state_from_weights` apply it.
* **Write atomically.** :func:`save_checkpoint_file` writes to a temporary file in the target
  directory, fsyncs, renames and fsyncs the directory, so the target is always either the old or the
  new complete checkpoint.
"""

from lightning_fusedsgd.checkpoint.errors import (
    CheckpointError,
    CheckpointMismatchError,
    InvalidOptimizerStateError,
)
from lightning_fusedsgd.checkpoint.files import (
    check_optimizer_state_dict,
    read_checkpoint_file,
    save_checkpoint_file,
)
from lightning_fusedsgd.checkpoint.foreign import StartState, read_start_checkpoint, seed_state_from_weights
from lightning_fusedsgd.checkpoint.remap import (
    load_optimizer_state,
    remap_optimizer_state_dict,
    same_param_layout,
)

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "InvalidOptimizerStateError",
    "StartState",
    "check_optimizer_state_dict",
    "load_optimizer_state",
    "read_checkpoint_file",
    "read_start_checkpoint",
    "remap_optimizer_state_dict",
    "same_param_layout",
    "save_checkpoint_file",
    "seed_state_from_weights",
]
