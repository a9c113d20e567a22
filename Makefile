# Two commands from a fresh clone:
#   make demo   - create .venv, install, run `lightning-stale demo`
#   make test   - create .venv, install with test extras, run the whole test suite
# TORCH_SPEC picks the torch build installed first (default: the local CPU build 2.13.0).
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

setup-test: $(BIN)/python
	$(BIN)/pip install -q -e ".[test]"

demo: setup
	$(BIN)/lightning-stale demo $(DEMO_ARGS)

test: setup-test
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
