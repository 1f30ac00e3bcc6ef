# The two set-up commands of README.md: `make train` (the default recipe) and `make test` (what CI runs).
# Each installs what it needs (the package editable, its extras, the compiled kernel) into the current Python.
PYTHON ?= python3
# The test tools' exact releases (constraints.txt); `make test-latest` empties it.
CONSTRAINTS ?= -c constraints.txt
# --no-compile: Python compiles what is imported when it is first imported; compiling all of torch ahead of time
# costs half a minute of every new environment's install.
PIP = $(PYTHON) -m pip install --quiet --disable-pip-version-check --no-compile
# Python writes its bytecode caches under make even where the environment says not to (PYTHONDONTWRITEBYTECODE,
# which many container images set): without them every process compiles torch and Lightning anew, about 9 s a
# start on 2 cores, and the tests start a few hundred processes.
export PYTHONDONTWRITEBYTECODE :=
# An install is redone only when what it reads changed: its stamp lies in the environment it went into, named
# by this checkout, so a new virtual environment (or one another checkout installed into) is installed anew.
STAMP := $(shell $(PYTHON) -c 'import hashlib, sys; print(sys.prefix + "/lightning_fusedsgd-" + hashlib.sha1(sys.argv[1].encode()).hexdigest()[:12])' $(CURDIR))
INSTALL_INPUTS = pyproject.toml setup.py constraints.txt
LATEST = build/venv-latest

.PHONY: install install-dev kernels lint train test test-all test-fast test-latest mutants docs bench

install: $(STAMP).stamp kernels  # the library, the recipe runner, and the kernel built for this machine
install-dev: $(STAMP)-dev.stamp kernels  # and what the tests and the docs need

$(STAMP).stamp: $(INSTALL_INPUTS)
	$(PIP) -e ".[recipes,jit]"
	touch $@

$(STAMP)-dev.stamp: $(INSTALL_INPUTS)
	$(PIP) -e ".[dev]" $(CONSTRAINTS)
	touch $@ $(STAMP).stamp

kernels:  # builds the kernel where its sources changed (the build cache is keyed by them); else only loads it
	$(PYTHON) -m lightning_fusedsgd

lint: install-dev  # ruff's checks and its formatting
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

train: install
	$(PYTHON) train.py

# The tests run on every core (pytest-xdist), each worker with its share of torch's threads (tests/conftest.py):
# most of a test's time is single-threaded (whole runs, imports, Hydra, subprocesses' start).
XDIST = -n auto --dist worksteal

test: lint  # what CI runs: the lint, then everything but the heavy tests, the docs build included (7 minutes on 2 cores)
	$(PYTHON) -m pytest -q -m "not heavy" $(XDIST)

test-all: lint  # and the heavy tests: the wheel build, kill-and-resume runs, bf16 on the CPU, the GPU benchmark's smoke run
	$(PYTHON) -m pytest -q $(XDIST)

test-fast: install-dev  # the inner loop: everything but whole runs, subprocesses and builds (under 2 minutes)
	$(PYTHON) -m pytest -q -m "not slow"

test-latest:  # make test in a new virtual environment with the newest releases the registries offer, tools unpinned
	rm -rf $(LATEST)
	$(PYTHON) -m venv $(LATEST)
	$(MAKE) test PYTHON=$(abspath $(LATEST))/bin/python CONSTRAINTS=
	$(LATEST)/bin/python -m pip list --format=freeze --disable-pip-version-check > build/test-latest-versions.txt

mutants: install-dev  # bugs injected into the CUDA kernels, one at a time: the emulated CUDA tests must catch each (not CI: 15-60 s a mutant)
	$(PYTHON) tests/mutants.py

docs: install-dev  # the site, in site/; a warning (a broken link or reference) fails
	$(PYTHON) docs/gen_benchmarks.py
	$(PYTHON) -m mkdocs build --strict

bench: install
	$(PIP) -e ".[bench]"
	$(PYTHON) bench/step.py && $(PYTHON) bench/lars.py && $(PYTHON) bench/ema.py
