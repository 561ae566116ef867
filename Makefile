# Two entry points for a fresh machine: `make run` (the main job) and `make test` (the suite).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
# PyTorch learners (the `torch` extra): a CPU build of torch is taken from a wheel in this
# folder when there is one for this Python (PyPI's Linux torch is the CUDA build, gigabytes of
# GPU libraries); else the extra installs torch from the index.
TORCH_WHEELS ?= /opt/wheels

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	@w=$$(ls $(TORCH_WHEELS)/torch-*+cpu-*-cp$$($(PY) -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')-*.whl 2>/dev/null | tail -1); \
	  if [ -n "$$w" ]; then echo "torch: $$w"; $(PY) -m pip install --quiet "$$w"; fi
	$(PY) -m pip install --quiet -e '.[torch]'
	$(PY) -m pip install --quiet -e '.[wan]' \
	  || echo "NetfilterQueue did not build (needs libnetfilter-queue-dev): WAN delay emulation is unavailable"
	touch $@

.PHONY: setup run test test-fast lint bench compose-test
setup: $(VENV)/.installed

# Extra options go in ARGS: `make run ARGS=--force` replaces the run out/ already holds,
# `make run ARGS="--resume out --steps 1000"` continues it.
ARGS ?=
run: $(VENV)/.installed
	$(VENV)/bin/ddiloco run --baseline dp --out out $(ARGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	rm -rf build/typecheck && mkdir -p build/typecheck/ddiloco
	ln -s $(CURDIR)/ddiloco/*.py build/typecheck/ddiloco/
	for layer in pipeline store workers chaos; do ln -s $(CURDIR)/$$layer build/typecheck/ddiloco/; done
	$(VENV)/bin/mypy

# Two passes: the tests that may share the cores run on two pytest-xdist workers (each test
# file on one worker); then, one at a time, the chaos runs whose goodput and timing the
# assertions judge and the root tests that change the host's network (marker `serial`, `root`).
test: $(VENV)/.installed lint
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not serial and not root" --durations=10
	$(PY) -m pytest -q -m "serial or root" --durations=10

# The edit loop: unit tests only (no real processes, namespaces or engines), a few minutes.
test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -m "not integration and not root" --durations=10

bench: $(VENV)/.installed
	$(PY) bench/codec.py
	$(PY) bench/syncer.py
	$(PY) bench/step.py

# The compose demo on a real Docker engine (root; installs the engine if missing, builds the
# images from Debian packages, kills and restarts a learner, restores the host): docs/COMPOSE.md.
compose-test:
	bash docker/compose-test.sh

# The same with compose's profile `ha` (Redis primary, two replicas, three sentinels): kills the
# primary's container and checks training goes on (docs/COMPOSE.md). Not part of CI's run.
.PHONY: compose-test-ha
compose-test-ha:
	bash docker/compose-test.sh ha
