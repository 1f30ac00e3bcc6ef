"""``python -m lightning_fusedsgd [--verbose]``: load, or build and cache, the compiled kernels ahead of first
use."""

from lightning_fusedsgd.ops._loader import main

raise SystemExit(main())
