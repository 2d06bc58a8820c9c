# The README's two commands: `make demo` and `make test`. Both set up everything on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch first, pinned: the CPU build on this machine's disk (an unpinned torch pulls a multi-GB CUDA build).
TORCH ?= torch==2.13.0

.PHONY: demo test install system-deps bench clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q --disable-pip-version-check "$(TORCH)"
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test]'
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/moescope demo

# Real servers the integration tests use (Debian packages); CI runs as root.
system-deps:
	bash .ci/system-deps

test: install system-deps
	bash .ci/pytest

bench: install
	$(BIN)/python benchmarks/runtime.py

clean:
	rm -rf $(VENV) .pytest_cache
