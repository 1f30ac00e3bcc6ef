"""The recipe runner behind ``python train.py recipe=NAME``: DataModules (``data``), the image classifier
(``model``), the end-of-run summary (``summary``) and the run itself (``run``). An application of the library,
not part of it: it needs the ``recipes`` extra (torchvision, Hydra, torchmetrics, scikit-learn, matplotlib),
``pip install "lightning_fusedsgd[recipes]"``."""
