# Two commands do all set-up: `make demo` (the main job) and `make test` (the tests).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# Where no NVIDIA GPU is present, take PyTorch's CPU wheels instead of a multi-GB CUDA build.
TORCH_INDEX ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 || echo https://download.pytorch.org/whl/cpu)

.PHONY: demo test venv clean bench

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@if [ -n "$(TORCH_INDEX)" ]; then \
	  echo "no GPU found: installing PyTorch's CPU build"; \
	  $(PIP) install -q --retries 1 --index-url $(TORCH_INDEX) "torch>=2.4"; \
	fi
	$(PIP) install -q -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(PY) -m glassformer demo

test: venv
	sh scripts/ensure_browser.sh
	$(PY) -m pytest

bench: venv
	$(PY) bench/run_all.py

clean:
	rm -rf $(VENV) build dist *.egg-info runs demo-out
