# Two entry points for a fresh machine: `make run` (the main job) and `make test` (the suite).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	$(PY) -m pip install --quiet -e '.[wan]' \
	  || echo "NetfilterQueue did not build (needs libnetfilter-queue-dev): WAN delay emulation is unavailable"
	touch $@

.PHONY: setup run test lint bench
setup: $(VENV)/.installed

run: $(VENV)/.installed
	$(VENV)/bin/ddiloco run --baseline dp --out out

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

test: $(VENV)/.installed lint
	$(PY) -m pytest -q

bench: $(VENV)/.installed
	$(PY) bench/codec.py
	$(PY) bench/syncer.py
	$(PY) bench/step.py
