"""``ckpt_path=auto`` and ``ckpt_path=last``: the checkpoint to resume, found among the run directories.

A run directory's checkpoints are ``checkpoints/last.ckpt`` (at every epoch end, every
``callbacks.step_checkpoint.every_n_train_steps`` steps, and where a signal stopped the run: see
:mod:`runner.interrupt`) and Lightning's ``hpc_ckpt_<n>.ckpt`` (its SLURM requeue). Each is complete: the
files are written atomically (``AtomicCheckpointIO``). The run resumes the newest one (by modification time)
of:

1. its own run directory: a fixed ``hydra.run.dir`` run again, a requeued SLURM job whose run directory is
   keyed by its job id, a submitit job of a sweep;
2. where it has none, the run directories its ``hydra.run.dir`` makes at other times: the template with its
   ``${now:...}`` parts left open (``outputs/<name>/*`` by default, the same recipe). A fixed run directory
   has no others, nor has a job of a sweep (its siblings ran other overrides).

Lightning's own ``ckpt_path="last"`` looks in this run's new directory only, finds nothing there, and trains
from scratch with a warning; here ``last`` resumes as ``auto`` does, and is refused where there is nothing to
resume.
"""

from __future__ import annotations

import re
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.pytorch.utilities import rank_zero_info
from omegaconf import DictConfig, open_dict

from lightning_fusedsgd.lightning import ConfigError

__all__ = ["LAST_CHECKPOINT", "resolve_ckpt_path"]

LAST_CHECKPOINT = Path("checkpoints", "last.ckpt")  # in a run directory
_NOW = re.compile(r"\$\{now:[^}]*\}")


def resolve_ckpt_path(cfg: DictConfig) -> str | None:
    """``cfg.ckpt_path`` with ``auto`` and ``last`` replaced by the checkpoint they find (``auto`` also by
    None: a new run, said in one line); any other value as it is.

    Raises:
        ConfigError: For ``last`` where no run directory holds a checkpoint, naming where it looked.
    """
    if cfg.ckpt_path not in ("auto", "last"):
        return cfg.ckpt_path
    own = Path(cfg.output_dir)
    others = _other_run_dirs(cfg)
    found = _newest(own) or (_newest_of(others) if others else None)
    where = f"{own}" + (f" or {others}" if others else "")
    if found is None:
        looked = f"no checkpoint ({LAST_CHECKPOINT}, hpc_ckpt_*.ckpt) in {where}"
        if cfg.ckpt_path == "last":
            raise ConfigError(
                f"ckpt_path=last: nothing to resume: {looked}; ckpt_path=auto starts a new run then"
            )
        rank_zero_info(f"ckpt_path=auto: {looked}: starting a new run")
        return None
    rank_zero_info(f"ckpt_path={cfg.ckpt_path}: resuming {found}, the newest checkpoint in {where}")
    return str(found)


def _newest(run_dir: Path) -> Path | None:
    """The newest checkpoint a run directory holds, or None."""
    candidates = [run_dir / LAST_CHECKPOINT, *run_dir.glob("hpc_ckpt_*.ckpt")]
    existing = [path for path in candidates if path.is_file()]
    return max(existing, key=_modified, default=None)


def _newest_of(pattern: str) -> Path | None:
    """The newest checkpoint of the run directories that match ``pattern``, an absolute glob."""
    root = Path(Path(pattern).anchor)
    found = [_newest(run_dir) for run_dir in root.glob(str(Path(pattern).relative_to(root)))]
    return max((path for path in found if path is not None), key=_modified, default=None)


def _modified(path: Path) -> float:
    return path.stat().st_mtime


def _other_run_dirs(cfg: DictConfig) -> str | None:
    """A glob of the run directories this run's layout makes at other times: ``hydra.run.dir`` with its
    ``${now:...}`` parts left open and the rest resolved as for this run (absolute); None for a fixed run
    directory, a job of a sweep, or a run outside Hydra."""
    if not HydraConfig.initialized():
        return None
    hydra = HydraConfig.get()
    if hydra.mode == RunMode.MULTIRUN:
        return None
    template = hydra.run._get_node("dir")._value()
    pattern = _NOW.sub("*", template)
    if pattern == template:
        return None
    resolving = (
        cfg.copy()
    )  # the pattern's other interpolations (${name}, ${oc.env:...}) resolved as this run's
    with open_dict(resolving):
        resolving["_run_dirs"] = pattern
    return str(Path(hydra.runtime.cwd, resolving["_run_dirs"]))
