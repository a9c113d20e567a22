# Two commands from a fresh clone:
#   make demo   - create .venv, install, run `lightning-stale demo`
#   make test   - create .venv, install with test extras, run the whole test suite
# TORCH_SPEC picks the torch build installed first (default: the local CPU build 2.13.0); the test extras are installed
# with it pinned, so that no dependency replaces it.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test setup setup-test clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"

setup: $(BIN)/python
	$(BIN)/pip install -q -e .

# LitGPT's text pipeline (TextFiles) reads through litdata, which requires torchvision; PyPI's torchvision is built
# for CUDA torch, cannot be imported beside the CPU build (nor can `transformers.Trainer` then), and litdata's
# tokenising and streaming do not use it: litdata is installed without its dependencies, and those it imports that the
# test extras lack (boto3, and tifffile for older releases) by name. 0.2.51 (LitGPT's pin) is the oldest checked.
LITDATA_SPEC ?= litdata>=0.2.51

setup-test: $(BIN)/python
	$(BIN)/pip install -q -e ".[test]" "$(TORCH_SPEC)"
	$(BIN)/pip install -q boto3 tifffile
	$(BIN)/pip install -q --no-deps "$(LITDATA_SPEC)"

demo: setup
	$(BIN)/lightning-stale demo $(DEMO_ARGS)

test: setup-test
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
