# The two set-up commands of README.md: `make train` (the default recipe) and `make test`.
# Each installs what it needs (the package, its dependencies, the compiled kernel) into the current Python.
PYTHON ?= python3

.PHONY: install train test bench

install:
	$(PYTHON) -m pip install --quiet --disable-pip-version-check -e ".[dev]"
	$(PYTHON) -m lightning_fusedsgd

train: install
	$(PYTHON) train.py

test: install
	$(PYTHON) -m pytest -q

bench: install
	$(PYTHON) -m pip install --quiet --disable-pip-version-check -e ".[bench]"
	$(PYTHON) bench/step.py && $(PYTHON) bench/lars.py
