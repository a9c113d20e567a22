# Two commands from a fresh clone:
#   make demo   - create .venv, install, run `lightning-stale demo`
#   make test   - create .venv, install with test extras, run the whole test suite
# TORCH_SPEC picks the torch release installed first: the local CPU build 2.13.0 by default, any other release from
# PyPI (a CUDA build; it runs on the CPU too), e.g. `make test TORCH_SPEC="torch==2.6.0"`, the oldest supported. A
# release newer than a pip cap set in pip's configuration needs the cap lifted for that command:
# `PIP_CONSTRAINT=/dev/null make test TORCH_SPEC="torch==2.15.0"`. Each TORCH_SPEC gets its own virtual environment
# (.venv for the default, .venv-<spec> for others), so switching releases never tests the one installed before; the
# test extras are installed with TORCH_SPEC pinned, so that no dependency replaces it.
PYTHON ?= python3
DEFAULT_TORCH := torch==2.13.0
TORCH_SPEC ?= $(DEFAULT_TORCH)
VENV ?= $(if $(filter $(DEFAULT_TORCH),$(TORCH_SPEC)),.venv,.venv-$(shell printf '%s' '$(TORCH_SPEC)' | tr -c 'A-Za-z0-9.' '-'))
# torchao releases import on a few torch releases each (0.17 and later need torch 2.7 or newer): where the newest
# torchao does not import on TORCH_SPEC, the tests take this one, the newest that imports on every supported torch.
TORCHAO_FALLBACK ?= torchao==0.16.0
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
	$(BIN)/python -c "import torchao.optim" >/dev/null 2>&1 || $(BIN)/pip install -q "$(TORCHAO_FALLBACK)" "$(TORCH_SPEC)"
	$(BIN)/pip install -q boto3 tifffile
	$(BIN)/pip install -q --no-deps "$(LITDATA_SPEC)"
	$(BIN)/python -c "import torch, torchao; print('torch', torch.__version__, '| torchao', torchao.__version__)"

demo: setup
	$(BIN)/lightning-stale demo $(DEMO_ARGS)

test: setup-test
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf .venv .venv-* *.egg-info .pytest_cache
