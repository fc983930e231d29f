# The two commands that do everything on a fresh machine:
#   make demo   — venv, then renders the demo video on embedded defaults (no servers)
#   make test   — venv, system tools, services, then the whole test suite
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
DEMO_OUT ?= out/demo.mp4

.PHONY: demo test test-fast lint typecheck check services sysdeps bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	@mkdir -p $(dir $(DEMO_OUT))
	$(BIN)/longtake render --image models/checkpoints/demo_reference.png --audio assets/demo/speech.wav \
	    --text "a friendly presenter in a bright studio" --out $(DEMO_OUT)
	@echo "demo video: $(DEMO_OUT)"

sysdeps:
	@bash ops/ci/sysdeps.sh

services:
	@bash ops/ci/services.sh

test: $(STAMP) sysdeps services
	$(BIN)/ruff check pipeline models worker bench tests
	$(BIN)/lint-imports
	$(BIN)/mypy
	$(BIN)/pytest -q tests

test-fast: $(STAMP)
	$(BIN)/pytest -q tests -m "not integration and not distributed and not slow"

lint: $(STAMP)
	$(BIN)/ruff check pipeline models worker bench tests
	$(BIN)/lint-imports

typecheck: $(STAMP)
	$(BIN)/mypy

check: lint typecheck test

clean:
	rm -rf $(VENV) out .pytest_cache .mypy_cache .ruff_cache
