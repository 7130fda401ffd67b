# Two commands do all set-up: `make demo` (the main job) and `make test` (the tests).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# Where no NVIDIA GPU is present, take PyTorch's CPU wheels instead of a multi-GB CUDA build.
TORCH_INDEX ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 || echo https://download.pytorch.org/whl/cpu)

.PHONY: demo chat-demo test test-llamacpp venv clean bench

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@if [ -n "$(TORCH_INDEX)" ]; then \
	  echo "no GPU found: installing PyTorch's CPU build"; \
	  torch=$$($(PYTHON) scripts/floors.py --requirement torch) || exit 1; \
	  $(PIP) install -q --retries 1 --index-url $(TORCH_INDEX) "$$torch"; \
	fi
	$(PIP) install -q -e ".[dev]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(PY) -m glassformer demo

# The chat demo (docs/chat.md#the-chat-demo): the chat preset trained on Shakespeare, then fine-tuned
# on conversations from the plays' dialogue with the assistant-only loss, then two lines of chat.
CHAT_OUT    ?= demo-out/chat
CHAT_BUDGET ?= 120
chat-demo: venv
	test -f demo-out/data/meta.json || $(PY) -m glassformer prepare --out demo-out/data
	rm -rf $(CHAT_OUT)/base $(CHAT_OUT)/run
	$(PY) -m glassformer train --data demo-out/data --out $(CHAT_OUT)/base --preset chat --time-budget $(CHAT_BUDGET)
	$(PY) -m glassformer.text.dialogue $(CHAT_OUT)/plays.jsonl
	$(PY) -m glassformer prepare --chat $(CHAT_OUT)/plays.jsonl --tokenizer $(CHAT_OUT)/base --out $(CHAT_OUT)/data
	$(PY) -m glassformer train --data $(CHAT_OUT)/data --init-from $(CHAT_OUT)/base --out $(CHAT_OUT)/run \
	  --time-budget $(CHAT_BUDGET)
	printf 'Good morrow, my lord.\nWhat news from the court?\n' | \
	  $(PY) -m glassformer chat --checkpoint $(CHAT_OUT)/run --temperature 0.8 --top-k 40 --seed 0
	@echo "talk to it: $(PY) -m glassformer chat --checkpoint $(CHAT_OUT)/run --temperature 0.8 --top-k 40"

test: venv
	sh scripts/ensure_browser.sh
	$(PY) -m pytest

# llama.cpp itself on what `convert --to-gguf` writes (docs/convert.md#gguf): installs the pinned
# llama-cpp-python (it compiles llama.cpp, about 4-6 minutes on 2 cores, once per machine with pip's
# cache), then runs the llamacpp-marked tests. Built for any x86-64 with AVX2 (GGML_NATIVE=OFF), not
# for this machine's CPU: the native build crashed (a segmentation fault) in q8_0 decoding on a CPU
# with AMX. A wheel pip cached before that (a native build) is dropped once, while the stamp is missing.
LLAMACPP := llama-cpp-python==0.3.36
LLAMACPP_STAMP := $(HOME)/.cache/glassformer/$(subst ==,-,$(LLAMACPP))-portable
test-llamacpp: venv
	@if [ ! -f "$(LLAMACPP_STAMP)" ]; then $(PIP) cache remove llama_cpp_python >/dev/null 2>&1 || true; fi
	CMAKE_ARGS="-DGGML_NATIVE=OFF" $(PIP) install -q "$(LLAMACPP)"
	mkdir -p "$(dir $(LLAMACPP_STAMP))" && touch "$(LLAMACPP_STAMP)"
	$(PY) -m pytest -m llamacpp

# The declared floors (pyproject.toml's >= versions) are tested floors. Where `make test` ran on
# exactly them, that run was the test; where it ran on newer releases, the suite (less the llamacpp
# tests, whose llama-cpp-python is pinned) runs again in $(FLOORS_VENV), every dependency at its floor.
FLOORS_VENV ?= .venv-floors
FLOORS_PY   := $(FLOORS_VENV)/bin/python
.PHONY: test-floors floors-suite
test-floors: venv
	@rc=0; $(PY) scripts/floors.py --check $(PY) || rc=$$?; \
	case $$rc in \
	  0) echo "$(VENV) is at the declared floors: make test ran the suite on them";; \
	  1) $(MAKE) --no-print-directory floors-suite;; \
	  *) exit $$rc;; \
	esac

$(FLOORS_VENV)/.installed: pyproject.toml scripts/floors.py
	rm -rf $(FLOORS_VENV)
	$(PYTHON) -m venv $(FLOORS_VENV)
	$(FLOORS_PY) -m pip install -q --upgrade pip
	$(PYTHON) scripts/floors.py --constraints $(FLOORS_VENV)/constraints.txt
	@if [ -n "$(TORCH_INDEX)" ]; then \
	  echo "no GPU found: installing PyTorch's CPU build"; \
	  $(FLOORS_PY) -m pip install -q --retries 1 --index-url $(TORCH_INDEX) -c $(FLOORS_VENV)/constraints.txt torch; \
	fi
	$(FLOORS_PY) -m pip install -q -c $(FLOORS_VENV)/constraints.txt -e ".[dev]"
	$(FLOORS_PY) scripts/floors.py --check
	touch $@

floors-suite: $(FLOORS_VENV)/.installed
	sh scripts/ensure_browser.sh
	$(FLOORS_PY) -m pytest -m "not llamacpp"

# The teaching notebooks at full length (notebooks/README.md; the tests run them in fast mode):
# each runs in notebooks-out/<name>/, its executed copy written to notebooks-out/<name>.ipynb.
.PHONY: notebooks
notebooks: venv
	$(PY) scripts/run_notebooks.py --out notebooks-out

bench: venv
	$(PY) bench/run_all.py

clean:
	rm -rf $(VENV) $(FLOORS_VENV) build dist *.egg-info runs demo-out
