"""The optimizers: :class:`FusedSGD` (``sgd.py``), :class:`FusedLARS` (``lars.py``) and
:class:`FusedSGDScheduleFree` (``schedule_free.py``), and how a step runs.

Inside, each module owns one part of a step: ``_step`` (the one path: which buckets run, norms, reduction,
update), ``_kept`` (a plan kept for the next steps), ``_state_dict`` (loading state dicts), ``_sparse``
(sparse gradients, through torch's own SGD), ``_lrs`` (the lrs as tensors: capturable steps), ``_plan`` (the
buckets, checked before anything is written), ``_overlap`` (params that share memory), ``_backends``
(compiled, reference or emulated CUDA ops), ``_dtensor`` (sharded params) and ``_zero`` (an engine's flat
partitions: DeepSpeed ZeRO, :func:`attach_deepspeed`). The hyperparameters' checks and
encodings are the kernel ABI's (``lightning_fusedsgd._abi``).
"""

from lightning_fusedsgd.optim._zero import attach_deepspeed
from lightning_fusedsgd.optim.lars import FusedLARS
from lightning_fusedsgd.optim.schedule_free import FusedSGDScheduleFree
from lightning_fusedsgd.optim.sgd import FusedSGD

__all__ = ["FusedLARS", "FusedSGD", "FusedSGDScheduleFree", "attach_deepspeed"]
