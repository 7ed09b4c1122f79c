# Two commands on a fresh machine: `make demo` and `make test`. Each builds .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test lint bench clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# the local CPU build of torch first, so the torch extra resolves to it
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[image,torch,dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/aioloader demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy aioloader

test: lint
	$(BIN)/pytest -q

bench: $(STAMP)
	$(BIN)/python benchmarks/remote_latency.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
