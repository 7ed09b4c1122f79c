# Two commands on a fresh machine: `make demo` and `make test`. Both use .venv: the demo
# installs only what it needs, the tests everything; each has its own stamp, in either order.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip install --quiet
STAMP := $(VENV)/.installed
# the project's bytecode, as a wheel install has it: with PYTHONDONTWRITEBYTECODE set, an
# editable install would compile every module again in each new process (0.2 s of aioloader's
# imports in each zygote and service)
BYTECODE = $(1)/python -m compileall -q aioloader benchmarks examples tests >/dev/null
DEMO_STAMP := $(VENV)/.installed-demo

.PHONY: install system-deps demo test lint bench bench-peers bench-dlio soak clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip

$(STAMP): pyproject.toml Makefile | $(BIN)/python
	# the local CPU build of torch first, so the torch extra resolves to it
	$(PIP) torch==2.13.0
	$(PIP) -e '.[all,dev]'
	touch $(STAMP)

# Azure's storage emulator for the az:// tests (the GCS one comes with the dev extra)
AZURITE := $(VENV)/azurite/node_modules/.bin/azurite-blob
$(AZURITE): | system-deps $(BIN)/python
	npm install --prefix $(VENV)/azurite --no-audit --no-fund --loglevel=error azurite@3.37.0

install: $(STAMP)

# the demo needs the core and Pillow: no torch, no development tools
$(DEMO_STAMP): pyproject.toml Makefile | $(BIN)/python
	$(PIP) -e '.[image]'
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(call BYTECODE,$(BIN))
	$(BIN)/aioloader demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy aioloader

# nginx serves plain static files to the tests (Range requests); Debian's nginx-light. npm
# installs Azurite.
system-deps:
	@missing=""; \
	{ command -v nginx >/dev/null || test -x /usr/sbin/nginx; } || missing="nginx-light"; \
	command -v npm >/dev/null || missing="$$missing npm"; \
	[ -z "$$missing" ] || { SUDO=$$( [ "$$(id -u)" -eq 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; }

test: lint system-deps $(AZURITE)
	$(call BYTECODE,$(BIN))
	$(BIN)/pytest -q

# SOAK_MINUTES=30 by default
soak: $(STAMP)
	$(call BYTECODE,$(BIN))
	$(BIN)/pytest -m soak -s --timeout=0 tests/test_soak.py

bench: $(STAMP)
	$(call BYTECODE,$(BIN))
	$(BIN)/python benchmarks/remote_latency.py
	$(BIN)/python benchmarks/tail_latency.py
	$(BIN)/python benchmarks/formats.py
	$(BIN)/python benchmarks/tfrecord_s3.py
	$(BIN)/python benchmarks/decode.py
	$(BIN)/python benchmarks/overhead.py
	$(BIN)/python benchmarks/from_torch.py
	$(BIN)/python benchmarks/cache.py
	$(BIN)/python benchmarks/memory.py
	$(BIN)/python benchmarks/reduced_decode.py
	$(BIN)/python benchmarks/gil.py
	$(BIN)/python benchmarks/node.py
	$(BIN)/python benchmarks/cluster.py
	$(BIN)/python benchmarks/large_samples.py
	$(BIN)/python benchmarks/mlperf_storage.py

# a benchmark's venv of its own, $(1), with the local CPU torch pinned (constraints.txt) first
define TORCH_VENV
	$(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install --quiet --upgrade pip
	$(1)/bin/python -m pip install --quiet torch==2.13.0
	echo torch==2.13.0 > $(1)/constraints.txt
endef

# the streaming loaders aioloader is compared with, and HF datasets, in a venv of their own
PEERS := .venv-peers
$(PEERS)/.installed: benchmarks/peers-requirements.txt pyproject.toml
	$(call TORCH_VENV,$(PEERS))
	$(PEERS)/bin/python -m pip install --quiet -c $(PEERS)/constraints.txt \
		-r benchmarks/peers-requirements.txt
	$(PEERS)/bin/python -m pip uninstall --quiet -y torchvision
	$(PEERS)/bin/python -m pip install --quiet -c $(PEERS)/constraints.txt -e '.[s3,image,parquet]'
	touch $@

bench-peers: $(PEERS)/.installed
	$(call BYTECODE,$(PEERS)/bin)
	$(PEERS)/bin/python benchmarks/peers.py
	$(PEERS)/bin/python benchmarks/parquet.py
	$(PEERS)/bin/python benchmarks/shuffle_quality.py

# DLIO 2.0.0 (MLPerf Storage's engine) with aioloader as its data-loader plugin, in a venv of
# its own; MPI from Debian
DLIO := .venv-dlio
$(DLIO)/.installed: benchmarks/dlio-requirements.txt pyproject.toml
	@command -v mpirun >/dev/null || { SUDO=$$( [ "$$(id -u)" -eq 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install \
		-y -qq --no-install-recommends openmpi-bin libopenmpi-dev; }
	$(call TORCH_VENV,$(DLIO))
	$(DLIO)/bin/python -m pip install --quiet -c $(DLIO)/constraints.txt \
		-r benchmarks/dlio-requirements.txt
	$(DLIO)/bin/python -m pip install --quiet --no-deps dlio-benchmark==2.0.0
	$(DLIO)/bin/python -m pip install --quiet -c $(DLIO)/constraints.txt -e ".[tfrecord]"
	touch $@

bench-dlio: $(DLIO)/.installed
	PATH=$(CURDIR)/$(DLIO)/bin:$$PATH $(DLIO)/bin/python benchmarks/dlio.py

clean:
	rm -rf $(VENV) $(PEERS) $(DLIO) .pytest_cache .mypy_cache .ruff_cache
