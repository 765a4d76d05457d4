# The README's two commands: `make train` and `make test`. Each first sets up what is missing, once:
#   .venv/                   a project-local virtual environment, made with $(PYTHON) (>= 3.10)
#   .venv/.nsp-installed     stamp: nsp installed into .venv in editable mode with its [dev] extra,
#                            its C++ kernels (ffi/) built by pip through scikit-build-core and CMake
# Python changes under nsp/ and models/ need no reinstall (the install is editable). nsp is reinstalled, and
# its kernels rebuilt, only when pyproject.toml, CMakeLists.txt or anything under ffi/ is newer than the stamp.
# Deleting .venv starts over.
#
#   make train ARGS="--model tiny --steps 5 --seq 64"   options for `nsp train` (nsp train --help lists them)
#   make test PYTEST_ARGS="-m 'not slow'"              options for pytest (here: skip the clean-clone test)
#   make test TEST_WORKERS=                            the suite in one process (default: a worker per core)
#   make setup                                         only the set-up
#   PYTHON=python3.12 make train                       the Python that creates .venv (default: python3)

PYTHON ?= python3
ARGS ?=
PYTEST_ARGS ?=
# pytest-xdist workers for `make test`: one per core by default, each taking whole files (their module fixtures
# then run once); TEST_WORKERS= (empty) runs the suite in this one process.
TEST_WORKERS ?= auto

VENV := .venv
VENV_PY := $(VENV)/bin/python
INSTALLED := $(VENV)/.nsp-installed
INSTALL_LOG := $(VENV)/nsp-install.log
# What the C++ build (and the package's metadata) depends on; `find` also lists ffi/ itself, whose time changes
# when a file there is added or removed.
BUILD_INPUTS := pyproject.toml CMakeLists.txt $(shell find ffi -print)

.DEFAULT_GOAL := help
.PHONY: help setup train test

help:
	@echo "make train   set up .venv if needed, then run nsp train"
	@echo "make test    set up .venv if needed, then run the test suite"
	@echo "make setup   only the set-up"
	@echo "options: ARGS=\"...\" for nsp train, PYTEST_ARGS=\"...\" for pytest, PYTHON=... to create .venv"

setup: $(INSTALLED)

train: $(INSTALLED)
	$(VENV)/bin/nsp train $(ARGS)

# pytest exits 5 when it collected no tests: that is a failure here, a suite that runs nothing proves nothing.
test: $(INSTALLED)
	$(info $(VENV_PY) -m pytest -q $(if $(TEST_WORKERS),-n $(TEST_WORKERS) --dist loadfile) $(PYTEST_ARGS))
	@$(VENV_PY) -m pytest -q $(if $(TEST_WORKERS),-n $(TEST_WORKERS) --dist loadfile) $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests; failing, a suite that runs nothing proves nothing" >&2; fi; \
	exit $$rc

$(VENV)/pyvenv.cfg:
	@command -v $(PYTHON) >/dev/null 2>&1 || { \
	  echo "error: '$(PYTHON)' not found; nsp needs Python >= 3.10: pass one, e.g. make $(or $(MAKECMDGOALS),setup) PYTHON=python3.11" >&2; exit 1; }
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10))' || { \
	  echo "error: nsp needs Python >= 3.10, '$(PYTHON)' is $$($(PYTHON) --version 2>&1); pass another, e.g. make $(or $(MAKECMDGOALS),setup) PYTHON=python3.11" >&2; exit 1; }
	@echo "creating $(VENV) with $(PYTHON) ($$($(PYTHON) --version 2>&1)) ..."
	@$(PYTHON) -m venv $(VENV) || { rm -f $@; echo "error: '$(PYTHON) -m venv $(VENV)' failed (on Debian/Ubuntu: apt install python3-venv)" >&2; exit 1; }

# The stamp takes the time the install started (touched first, moved into place on success), so that a file
# changed during the build makes the next run build again.
$(INSTALLED): $(VENV)/pyvenv.cfg $(BUILD_INPUTS)
	@if [ -e $@ ]; then \
	  echo "rebuilding nsp's C++ kernels and reinstalling nsp into $(VENV), changed: $(sort $(filter-out $(VENV)/pyvenv.cfg,$?)) (about a minute; log in $(INSTALL_LOG)) ..."; \
	else \
	  echo "installing nsp and its dependencies into $(VENV), building its C++ kernels (about a minute; log in $(INSTALL_LOG)) ..."; \
	fi
	@touch $@.new
	@$(VENV_PY) -m pip install -e ".[dev]" >$(INSTALL_LOG) 2>&1 || { \
	  tail -n 40 $(INSTALL_LOG) >&2; echo "error: installing nsp into $(VENV) failed; the whole log is in $(INSTALL_LOG)" >&2; exit 1; }
	@mv -f $@.new $@
