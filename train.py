"""Train an image classifier with FusedSGD/LARS: ``python train.py [recipe=NAME] [key=value ...]``.

The config is ``conf/train.yaml`` plus a recipe from ``conf/recipe/`` (default ``quickstart``);
``python train.py recipe=NAME --cfg job`` prints the composed config.
"""

import logging
import sys

import hydra
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> None:
    # Heavy imports after Hydra has parsed the command line, so --help and --cfg stay instant.
    from lightning_fusedsgd.checkpoint import CheckpointError
    from lightning_fusedsgd.lightning.errors import ConfigError
    from lightning_fusedsgd.lightning.runner import train

    # `import lightning` gives its logger a console handler; Hydra's root handlers already print to the
    # console and to <run dir>/train.log, so without this every Lightning line would appear twice.
    logging.getLogger("lightning").handlers.clear()
    try:
        train(cfg)
    except (ConfigError, CheckpointError) as err:  # a user mistake or a bad file: its message, no traceback
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
