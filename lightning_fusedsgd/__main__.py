"""``python -m lightning_fusedsgd [--verbose]``: build and cache the compiled kernel ahead of first use."""

from lightning_fusedsgd.kernels import main

raise SystemExit(main())
