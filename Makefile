# Two commands on a fresh machine: `make demo` and `make test`. Each builds .venv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install system-deps demo test lint bench soak clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# the local CPU build of torch first, so the torch extra resolves to it
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[image,torch,s3,dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/aioloader demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy aioloader

# nginx serves plain static files to the tests (Range requests); Debian's nginx-light
system-deps:
	@command -v nginx >/dev/null || test -x /usr/sbin/nginx || { \
		SUDO=$$( [ "$$(id -u)" -eq 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq nginx-light; }

test: lint system-deps
	$(BIN)/pytest -q

# SOAK_MINUTES=30 by default
soak: $(STAMP)
	$(BIN)/pytest -m soak -s --timeout=0 tests/test_soak.py

bench: $(STAMP)
	$(BIN)/python benchmarks/remote_latency.py
	$(BIN)/python benchmarks/formats.py
	$(BIN)/python benchmarks/decode.py
	$(BIN)/python benchmarks/overhead.py
	$(BIN)/python benchmarks/cache.py
	$(BIN)/python benchmarks/memory.py
	$(BIN)/python benchmarks/reduced_decode.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
