# Two entry points, each working alone on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

demo: $(BIN)/python
	$(BIN)/python -m pip install -q .
	$(BIN)/python examples/kimi_decode_step.py

test: $(BIN)/python
	$(BIN)/python -m pip install -q ".[test]"
	$(BIN)/ruff check .
	$(BIN)/pytest -q -ra tests

lint: $(BIN)/python
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) build dist *.egg-info
