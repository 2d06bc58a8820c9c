# The README's two commands: `make demo` and `make test`. Both set up everything on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch first, pinned: the CPU build on this machine's disk (an unpinned torch pulls a multi-GB CUDA build).
TORCH ?= torch==2.13.0

.PHONY: demo test lint docs test-main test-hf457 install system-deps bench clean

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

# Lint and the docs site first (seconds; a failure stops here), then the whole suite (every benchmark's --quick
# included: tests/test_benchmarks.py), then the HF adapter tests again on transformers 4.57 (module names and
# router outputs differ between 4.x and 5.x) in a second venv.
test: lint docs test-main test-hf457

lint: install
	$(BIN)/ruff check .
	$(BIN)/lint-imports

# The docs site (mkdocs-material): --strict fails on a broken link, a missing page or a bad nav entry.
# No --quiet: mkdocs 1.6 then hides the warnings --strict fails on. (NO_MKDOCS_2_WARNING: material's
# end-of-life banner is not a docs problem.)
SITE ?= build/site
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir $(SITE)

test-main: install system-deps
	bash .ci/pytest

HF457 := .venv-hf457
$(HF457)/.installed: pyproject.toml
	$(PYTHON) -m venv $(HF457)
	$(HF457)/bin/pip install -q --disable-pip-version-check "$(TORCH)"
	# lean: only what the HF adapter tests import (the main venv carries the rest)
	$(HF457)/bin/pip install -q --disable-pip-version-check -e '.[metrics,hf]' pytest hypothesis 'transformers==4.57.*'
	touch $@

test-hf457: $(HF457)/.installed
	PYTHON_BIN=$(HF457)/bin/python bash .ci/pytest tests/test_hf_adapter.py tests/test_hf_parity.py

bench: install
	$(BIN)/python benchmarks/runtime.py

clean:
	rm -rf $(VENV) $(HF457) .pytest_cache $(SITE)
