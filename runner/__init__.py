"""The recipe runner behind ``python train.py recipe=NAME``: DataModules (``data``) over the data order
(``sampling``), the image folders' pipeline (``files``, ``decode``, ``augment``, ``image_pipeline``),
synthetic images (``synthetic``) and a generated JPEG folder (``jpeg_folder``); the image classifier
(``model``), the SimCLR module (``simclr``), images per second (``throughput``), the end-of-run summary
(``summary``), the guard against a PyTorch fault of bf16 runs on the CPU (``cpu_bf16``) and the run itself
(``run``). An application of the library, beside ``train.py``, ``conf/`` and ``recipes/`` in a checkout, and
not in the wheel: it needs the ``recipes`` extra (torchvision, TorchCodec, Hydra, torchmetrics, scikit-learn,
matplotlib), ``pip install -e ".[recipes]"``."""
