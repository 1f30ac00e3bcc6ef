"""The optimizers: :class:`FusedSGD` and :class:`FusedLARS` (``sgd.py``), and how their step runs.

Inside, each module owns one part of a step: ``_hparams`` (checking and encoding the groups), ``_plan`` (the
buckets, checked before anything is written), ``_dtensor`` (sharded params), ``_kept`` (a plan kept for the
next steps), ``_backends`` (compiled or reference ops) and ``_step`` (the one path: norms, reduction, update).
"""

from lightning_fusedsgd.optim.sgd import FusedLARS, FusedSGD

__all__ = ["FusedLARS", "FusedSGD"]
