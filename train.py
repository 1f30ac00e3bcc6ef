"""Train an image classifier with FusedSGD/LARS: ``python train.py [recipe=NAME] [key=value ...]``.

The config is ``conf/train.yaml`` (its groups: trainer, data, model, optim, schedule, callbacks, debug) plus a
recipe from ``recipes/`` (default ``quickstart``), a short delta over it; ``python train.py recipe=NAME
--cfg job`` prints the composed config; ``python train.py -m KEY=A,B ...`` runs a sweep, a job per
combination, and ends with their table (``runner.sweep``). Needs the ``recipes`` extra:
``pip install -e ".[recipes]"``.
"""

import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from runner.sweep import check_search_installed, run_job
from runner.targets import trusted_targets

ROOT = Path(__file__).resolve().parent  # the checkout: conf/, recipes/ and runner/
RECIPES = ROOT / "recipes"
# Hydra's settings, read by hydra.main and by the check of the command line before it.
VERSION_BASE, CONFIG_NAME = "1.3", "train"


def register_recipes(directory: Path = RECIPES) -> None:
    """Makes each ``recipes/NAME.yaml`` the option ``NAME`` of the config group ``recipe``, merged at the top
    of the config (``python train.py recipe=NAME``): the recipes sit at the top level, beside the ``conf/``
    groups they override, where Hydra would look for them in ``conf/recipe/``."""
    store = ConfigStore.instance()
    for path in sorted(directory.glob("*.yaml")):
        store.store(group="recipe", name=path.stem, node=OmegaConf.load(path), package="_global_")


@hydra.main(version_base=VERSION_BASE, config_path="conf", config_name=CONFIG_NAME)
def main(cfg: DictConfig) -> float | None:
    # Heavy imports after Hydra has parsed the command line, so --help and --cfg stay instant.
    from lightning_fusedsgd.checkpoint import CheckpointError
    from lightning_fusedsgd.lightning import ConfigError
    from runner.run import train

    # `import lightning` gives its logger a console handler; Hydra's root handlers already print to the
    # console and to <run dir>/train.log, so without this every Lightning line would appear twice.
    logging.getLogger("lightning").handlers.clear()
    if HydraConfig.get().mode == RunMode.MULTIRUN:
        return run_job(cfg)  # a failed job is recorded and the sweep goes on; its value is optuna's objective
    try:
        train(cfg)
    except (ConfigError, CheckpointError) as err:  # a user mistake or a bad file: its message, no traceback
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


register_recipes()

if __name__ == "__main__":
    check_search_installed(sys.argv[1:])
    from runner.overrides import refused_key  # Hydra's only: --help stays instant

    # A key the config lacks, as Hydra would refuse it ("use +optim.lrr"), said here naming the nearest key.
    if (problem := refused_key(sys.argv[1:], ROOT / "conf", CONFIG_NAME, VERSION_BASE)) is not None:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    # The runner is this checkout's, not installed: a process a launcher starts from a pickle (Hydra's
    # submitit launcher, local or sbatch) imports runner/ through PYTHONPATH, as this one does by sys.path.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    with trusted_targets():  # Hydra 1.4 instantiates hydra.callbacks, too, only within a target whitelist
        main()
