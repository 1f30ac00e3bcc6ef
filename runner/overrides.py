"""The overrides a user types on ``train.py``'s command line, checked against the config they change.

- A key the config lacks (``optim.lrr=0.1``): Hydra refuses it while composing, before ``train.py``'s main
  runs, with "use +optim.lrr" (which adds a key the optimizer then refuses). :func:`refused_key` composes the
  command line first, as Hydra will, and says instead which key is nearest, which option of the group has
  the key, or which other node sets it (``optim.ema_decay`` is ``ema.decay``).
- An override the run would not use: :func:`check_typed_overrides` refuses ``optim.base_lr`` typed where
  ``optim.lr`` is set (the peak as given) and a schedule key the chosen decay does not read;
  :func:`applied_schedule` leaves out, saying so, the keys a recipe set for its own decay that the schedule a
  user chose does not read (``recipe=resnet50 schedule=cosine``: the recipe's milestones).
"""

from __future__ import annotations

import difflib
import functools
import inspect
import itertools
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hydra import initialize_config_dir
from hydra._internal.utils import get_args_parser  # train.py's own command-line parser (hydra.main's)
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import ConfigCompositionException, HydraException
from hydra.types import RunMode
from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

__all__ = ["DECAY_KEYS", "applied_schedule", "check_typed_overrides", "refused_key"]

log = logging.getLogger(__name__)

_NO_EMA_WARMUP = "not set in the runner: its average (ema.*) is Lightning's EMAWeightAveraging, no warmup"
# The options of the optimizers and of configure_fused_sgd that are no key of an optim config, because
# another node sets them (one way to set each) or the runner has no use for them.
SET_ELSEWHERE = {
    "optim.ema_decay": "ema.decay (the average of the weights, which validation runs on)",
    "optim.ema_every": "ema.update_every_n_steps",
    "optim.ema_start": "ema.update_starting_at_step",
    "optim.ema_warmup_gamma": _NO_EMA_WARMUP,
    "optim.ema_warmup_power": _NO_EMA_WARMUP,
    "optim.max_grad_norm": "trainer.gradient_clip_val (trainer.gradient_clip_algorithm=norm, the default)",
    "optim.max_grad_value": "trainer.gradient_clip_val with trainer.gradient_clip_algorithm=value",
    "optim.warmup_steps": "schedule.warmup (in schedule.unit, epochs unless set)",
    "optim.schedule": "the schedule node: schedule=<name> and schedule.<key>=...",
    "optim.batch_size": "data.batch_size (per device; the lr scales with the global batch)",
    "optim.schedule_free": "optim=schedule_free",
    "optim.foreach": "not set in the runner: FusedSGD accepts it as torch.optim.SGD does, and it chooses "
    "nothing (every step runs the fused kernel)",
    "optim.fused": "not set in the runner: FusedSGD accepts it as torch.optim.SGD does, and it chooses "
    "nothing (every step runs the fused kernel)",
    "optim.differentiable": "not set in the runner: the fused step is not differentiable",
}

# The schedule keys each decay reads (WarmupSchedule's formulas); the warmup's keys (warmup, unit,
# start_factor, start_lr) every decay reads.
DECAY_KEYS = {"milestones": ("multistep",), "gamma": ("multistep",), "power": ("poly",)}
DECAY_KEYS["end_lr"] = ("cosine", "poly", "linear")

_NOT_CHECKED = ("help", "hydra_help", "info", "shell_completion", "experimental_rerun")
_OTHER_CONFIG = ("config_path", "config_name", "config_dir")


def refused_key(args: Sequence[str], config_dir: Path, config_name: str, version_base: str) -> str | None:
    """Why ``args`` (``train.py``'s command line) would change a key the composed config lacks, in one line
    naming the nearest key; None where every key it changes exists. Each job of a ``-m`` sweep is checked
    (each choice of a swept group; a swept key's first value). Hydra reports its other errors itself: so do
    ``--help``, ``--info`` and another config's command lines, left to it."""
    if "--version" in args:
        return None
    try:
        parsed_args = get_args_parser().parse_args(list(args))
    except SystemExit:  # an argument Hydra's parser refuses: Hydra says which
        return None
    if any(getattr(parsed_args, name) for name in (*_NOT_CHECKED, *_OTHER_CONFIG)):
        return None
    with initialize_config_dir(config_dir=str(config_dir), version_base=version_base):
        loader = GlobalHydra.instance().config_loader()
        # Under -m, first the sweep's own config (Hydra's: each swept group at its default), then each job.
        job, mode = parsed_args.overrides, RunMode.MULTIRUN if parsed_args.multirun else RunMode.RUN
        try:
            jobs = _jobs(loader, config_name, job, parsed_args.multirun)
            for job in jobs:
                mode = RunMode.RUN
                loader.load_configuration(config_name, job, run_mode=mode)
        except ConfigCompositionException as error:
            cause = error.__cause__
            if not isinstance(cause, (ConfigAttributeError, ConfigKeyError)) or not cause.full_key:
                return None
            compose = functools.partial(loader.load_configuration, config_name, run_mode=mode)
            return _describe(compose, loader, job, parsed_args.overrides, cause.full_key)
        except HydraException:
            return None
    return None


def _jobs(loader: Any, config_name: str, overrides: list[str], multirun: bool) -> list[list[str]]:
    """The override lists of the jobs to check: the command line; under ``-m``, one per choice of each swept
    group (a swept key takes its first value: which keys exist depends on the groups chosen only)."""
    if not multirun:
        return [overrides]
    master = loader.load_configuration(config_name, overrides, run_mode=RunMode.MULTIRUN)
    groups = set(master.hydra.runtime.choices)
    options: list[list[str]] = []
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.get_key_element()
        if not override.is_sweep_override():
            options.append([override.input_line])
        elif not override.is_discrete_sweep():
            continue  # a range the sweeper draws from (optuna's interval): its sweeper composes each trial
        else:
            values = [f"{key}={value}" for value in override.sweep_string_iterator()]
            options.append(values if override.key_or_group in groups else values[:1])
    return [list(job) for job in itertools.product(*options)]


def _describe(
    compose: Callable[[list[str]], DictConfig], loader: Any, job: list[str], command: list[str], full_key: str
) -> str | None:
    """The one line for the override of ``job`` that sets ``full_key``, a key the config lacks, shown as the
    ``command`` line typed it (``compose`` composes a list of overrides as the refusing composition did)."""
    parser = OverridesParser.create()
    overrides = parser.parse_overrides(job)
    sets = [o for o in overrides if o.key_or_group == full_key or o.key_or_group.startswith(full_key + ".")]
    if not sets:
        return None
    typed = sets[0]
    typed_lines = [
        o.input_line for o in parser.parse_overrides(command) if o.key_or_group == typed.key_or_group
    ]
    line = typed_lines[0] if typed_lines else typed.input_line
    rest = [o.input_line for o in overrides if o is not typed]
    cfg = compose(rest)
    choices = cfg.hydra.runtime.choices
    path, _, key = full_key.rpartition(".")
    node = OmegaConf.select(cfg, path) if path else cfg
    if not isinstance(node, DictConfig):
        return None
    name = f"{path}={choices[path]}" if choices.get(path) else (path or "the config")
    start = f"{line}: {name} has no key {key}"
    if full_key in SET_ELSEWHERE:
        return f"{start}; it is {SET_ELSEWHERE[full_key]}"
    others = _options_with_key(compose, loader, rest, path, key) if path in choices else []
    if others:
        return f"{start}; it is a key of {', '.join(f'{path}={option}' for option in others)}"
    if full_key == typed.key_or_group and _target_takes(node, key):  # e.g. a Trainer argument
        value = line.split("=", 1)[1]
        return f"{start}; {node._target_} takes {key}: +{full_key}={value} adds it to the config"
    keys = [str(k) for k in node if not str(k).startswith("_")]
    nearest = difflib.get_close_matches(key, keys, n=1)
    if nearest:
        return f"{start}; did you mean {path + '.' if path else ''}{nearest[0]}?"
    return f"{start}; its keys: {', '.join(keys)}"


def _target_takes(node: Any, key: str) -> bool:
    """Whether the node's ``_target_`` takes an argument ``key`` of its own (not through ``**kwargs``)."""
    target = node.get("_target_") if isinstance(node, DictConfig) else None
    if not isinstance(target, str):
        return False
    try:
        parameter = inspect.signature(get_object(target)).parameters.get(key)
    except (ImportError, ValueError, TypeError, AttributeError):
        return False
    return parameter is not None and parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)


def _options_with_key(
    compose: Callable[[list[str]], DictConfig], loader: Any, rest: list[str], group: str, key: str
) -> list[str]:
    """The options of config group ``group`` whose config has ``key``."""
    found = []
    for option in loader.get_group_options(group):
        try:
            cfg = compose([*[o for o in rest if not o.startswith(f"{group}=")], f"{group}={option}"])
        except HydraException:
            continue
        if key in cfg[group]:
            found.append(option)
    return found


def _typed_keys() -> set[str]:
    """The keys the command line set (``key=value``), where Hydra composed the run's config."""
    if not HydraConfig.initialized():
        return set()
    overrides = OverridesParser.create().parse_overrides(list(HydraConfig.get().overrides.task))
    return {o.key_or_group for o in overrides if _sets_a_key(o)}


def _sets_a_key(override: Override) -> bool:
    return not override.is_delete() and override.package is None


def check_typed_overrides(cfg: DictConfig) -> None:
    """Refuses an override the run would not use: ``optim.base_lr`` or ``optim.reference_batch_size`` typed
    where ``optim.lr`` is set (the peak lr, as given), a schedule key typed that its decay does not read.

    Raises:
        ConfigError: naming the override and what to type instead.
    """
    from lightning_fusedsgd.lightning import ConfigError  # here: refused_key runs before Lightning is loaded

    typed = _typed_keys()
    lr = cfg.optim.get("lr")
    for key in ("base_lr", "reference_batch_size"):
        if f"optim.{key}" in typed and lr is not None:
            raise ConfigError(
                f"optim.{key}={cfg.optim[key]} is not used: optim.lr={lr} is the peak lr, as given; "
                f"add optim.lr=null to scale optim.base_lr with the global batch, or set optim.lr alone"
            )
    decay = cfg.schedule.get("decay")
    for key, decays in DECAY_KEYS.items():
        if f"schedule.{key}" in typed and decay not in decays:
            raise ConfigError(
                f"schedule.{key}={OmegaConf.to_container(cfg.schedule)[key]} is not used: "
                f"decay={decay!r} does not read it ({key} is {' and '.join(decays)}'s)"
            )


def applied_schedule(schedule: DictConfig) -> DictConfig:
    """``schedule`` without the keys its decay does not read (a recipe's milestones, where a user chose
    another schedule: ``recipe=resnet50 schedule=cosine``), each left out with a line saying so."""
    unread = [key for key, decays in DECAY_KEYS.items() if key in schedule and schedule.decay not in decays]
    if not unread:
        return schedule
    applied = schedule.copy()
    with open_dict(applied):
        for key in unread:
            del applied[key]
    shown = ", ".join(f"{key}={OmegaConf.to_container(schedule)[key]}" for key in unread)
    log.info(f"schedule: decay={schedule.decay!r} does not read the recipe's {shown}: left out")
    return applied
