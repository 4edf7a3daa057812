# Two entry points, each working alone on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
comma := ,
# On a machine with an NVIDIA driver, install the kernel path too (CuTe DSL, cuda-python).
GPU_EXTRA := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo gpu)
DEMO_EXTRAS := $(if $(GPU_EXTRA),[gpu],)
TEST_EXTRAS := [test$(if $(GPU_EXTRA),$(comma)gpu,)]

.PHONY: demo test lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

demo: $(BIN)/python
	$(BIN)/python -m pip install -q ".$(DEMO_EXTRAS)"
	$(BIN)/python examples/kimi_decode_step.py

test: $(BIN)/python
	$(BIN)/python -m pip install -q ".$(TEST_EXTRAS)"
	$(BIN)/ruff check .
	$(BIN)/pytest -q -ra tests

lint: $(BIN)/python
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) build dist *.egg-info
