# Two entry points: `make repro` (whole pipeline on the embedded default) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

# DVC telemetry tries to reach outside on every command; the stages find `python` in the venv.
export DVC_NO_ANALYTICS := 1
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: install repro test check-lock clean
install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

repro: install
	$(BIN)/dvc repro

test: install
	$(BIN)/python -m pytest

# Cheap freshness check: fails when dvc.lock does not match the code and params.
check-lock: install
	.ci/check-lock

clean:
	rm -rf $(VENV) .pytest_cache
