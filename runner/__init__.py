"""The recipe runner behind ``python train.py recipe=NAME``: DataModules (``data``, sharing ``datamodule``;
the image folders' in ``image_folder``) over the data order (``sampling``), every dataset's augmentation
(``augment``), the image folders' pipeline (``files``, ``decode``, ``image_pipeline``), synthetic images
(``synthetic``) and a generated JPEG folder (``jpeg_folder``); the image classifier (``model``), the SimCLR
module (``simclr``), images per second (``throughput``), the end-of-run summary (``summary``), resuming in an
epoch a stop cut short (``resume``), the guard against a PyTorch fault of bf16 runs on the CPU (``cpu_bf16``),
the run itself (``run``), a sweep's jobs and their table (``sweep``) and the configs' targets Hydra 1.4 may
instantiate (``targets``). An application of the library, beside ``train.py``, ``conf/`` and ``recipes/``
in a checkout, and not in the wheel: it needs the ``recipes`` extra (torchvision, TorchCodec, Hydra,
torchmetrics, scikit-learn, matplotlib), ``pip install -e ".[recipes]"``."""
