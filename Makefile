# SGLang 0.5.23 patch series: apply, refresh, wheel, test.
#
#   make wheel            # fetch + verify the pinned wheel, apply the series, pack dist/*.whl
#   make test             # .venv with the CPU deps + the built wheel, lint, pytest
#   make serve-cpu        # the patched server on CPU (tiny local model), foreground
#   make negative-controls # break a copy of the wheel per control: its tests must fail
#   make drift VERSION=X  # how each patch applies to release X (clean/offset/fuzz/conflict)
#   make rebase VERSION=X # carry the series to release X (git 3-way merge; new series + pin)
#   make pr FEATURE=x     # the group as an upstream PR (build/pr/x); pr-check runs its tests there
#
# Variables: PYTHON (the interpreter whose tag the wheel gets), PYTHON_TAG and
# WHEEL_PLATFORM (cross-target, e.g. cp312 / manylinux_2_34_aarch64), LABEL
# (local version label), FORCE=1 (apply over unexported work), GROUP (refresh:
# the series group new commits go to), FEATURE (pr; PR_AUTHOR="Name <email>"),
# PYTEST_ARGS, PORT, MODEL (tiny-llama, tiny-mla, tiny-dsa), L3 (none or mooncake: a
# Mooncake store started and stopped with the server) and SERVER_ARGS (serve-cpu),
# CONTROLS (negative-controls: cheap or all) and CONTROL (one control by name),
# TORCH_INDEX (where pip finds torch's CPU build; empty: pip's configuration).

PYTHON ?= python3
VENV ?= .venv
TOOLS := build/tools
LINT_UPSTREAM := build/lint-upstream
export PYTHON_TAG WHEEL_PLATFORM LABEL FORCE GROUP

PORT ?= 30000
SERVER_ARGS ?=
MODEL ?= tiny-llama
L3 ?= none

.PHONY: all sysdeps fetch apply refresh wheel venv install model serve-cpu test lint pytest negative-controls check-series drift rebase rebase-continue rebase-abort series-table pr pr-check gateway-venv clean distclean

all: wheel

fetch:
	$(PYTHON) scripts/upstream.py unpack

apply:
	$(PYTHON) scripts/series.py apply

refresh:
	$(PYTHON) scripts/series.py refresh

$(TOOLS)/.stamp: requirements/tools.txt
	$(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/python -m pip install -q -r requirements/tools.txt
	touch $@

# Applies the series first when build/src is missing or older than the series.
APPLY_IF_STALE = if [ ! -d build/src/.git ] || [ -n "$$(find patches -newer build/src/.git/HEAD -print -quit)" ]; then \
		$(PYTHON) scripts/series.py apply || exit $$?; fi

wheel: $(TOOLS)/.stamp
	@$(APPLY_IF_STALE)
	$(TOOLS)/bin/python scripts/build_wheel.py

# Upstream SGLang 0.5.23's own linters (isort, ruff, codespell at its versions),
# for the product files (scripts/lint_product.py); apart from .venv, whose
# isort and ruff lint this repository's code at other versions.
$(LINT_UPSTREAM)/.stamp: requirements/lint-upstream.txt
	$(PYTHON) -m venv $(LINT_UPSTREAM)
	$(LINT_UPSTREAM)/bin/python -m pip install -q --no-cache-dir -r requirements/lint-upstream.txt
	touch $@

# torch==2.13.0+cpu (requirements/test-cpu.txt) is PyTorch's CPU build, which PyPI
# does not carry: pip takes it from PyTorch's CPU wheel index, as PyTorch documents
# CPU installs (TORCH_INDEX= leaves its source to pip's own configuration). It is
# installed first and alone, so the other packages never query that index.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_PIN = $$(grep -E '^torch==' requirements/test-cpu.txt)

# --no-cache-dir: the venv is the only copy (CI's disk is small).  The
# torchvision stand-in hook only acts where torchvision's C++ ops cannot load
# (tests/standins/torchvision_ops.py says why).
# tests/standins/cpu_server_standins.py hooks the CPU-server stand-ins into processes
# started with SGLANG_TEST_CPU_SERVER_STANDINS=1 (live tests, serve-cpu) only.
$(VENV)/.stamp: requirements/test-cpu.txt requirements/lint.txt tests/standins/torchvision_ops.py tests/standins/cpu_server_standins.py
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --no-cache-dir --no-deps $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) $(TORCH_PIN)
	$(VENV)/bin/python -m pip install -q --no-cache-dir -r requirements/test-cpu.txt -r requirements/lint.txt
	$(VENV)/bin/python tests/standins/torchvision_ops.py
	$(VENV)/bin/python tests/standins/cpu_server_standins.py
	touch $@

venv: $(VENV)/.stamp

# The patched sglang under test is the built wheel, installed without deps.
install: venv wheel
	$(VENV)/bin/python -m pip install -q --no-deps --force-reinstall dist/sglang-*.whl

# The tiny local models of the live tests and serve-cpu (build/tiny-llama,
# build/tiny-mla: a DeepSeek-V3 with plain MLA, build/tiny-dsa: a DeepSeek-V3.2,
# build/tiny-llama-bos: tiny-llama whose tokenizer adds BOS).
model: venv
	$(VENV)/bin/python scripts/tiny_model.py tiny-llama
	$(VENV)/bin/python scripts/tiny_model.py tiny-llama-bos
	$(VENV)/bin/python scripts/tiny_model.py tiny-mla
	$(VENV)/bin/python scripts/tiny_model.py tiny-dsa

# The drop-in server from the built wheel, on CPU, in the foreground on
# 127.0.0.1:$(PORT); Ctrl-C / SIGTERM stop it and everything it started.
serve-cpu: install model
	$(VENV)/bin/python scripts/cpu_server.py --port $(PORT) --model $(MODEL) --l3 $(L3) -- $(SERVER_ARGS)

# This repository's code with .venv's linters, then every product file the
# series adds or changes (build/src, applied first when stale) with upstream's.
lint: venv $(LINT_UPSTREAM)/.stamp
	$(VENV)/bin/python -m black --check scripts tests benchmark
	$(VENV)/bin/python -m isort --check-only scripts tests benchmark
	$(VENV)/bin/python -m ruff check scripts tests benchmark
	$(VENV)/bin/codespell scripts tests benchmark README.md docs
	@$(APPLY_IF_STALE)
	$(PYTHON) scripts/lint_product.py

pytest: sysdeps install model $(LINT_UPSTREAM)/.stamp
	$(VENV)/bin/python scripts/pytest_lanes.py $(PYTEST_ARGS)

test: sysdeps lint pytest

# Break a scratch copy of the installed wheel once per control (never .venv,
# never build/src) and require the control's tests to fail on their
# assertions (scripts/negative_controls.py; docs/testing.md, "Negative
# controls"). CONTROLS=cheap: the unit-test controls only; CONTROL=<name>: one.
CONTROLS ?= all
CONTROL ?=
negative-controls: install model
	$(VENV)/bin/python scripts/negative_controls.py --set $(CONTROLS) $(if $(CONTROL),--control $(CONTROL))

# quilt, patch, g++, libssl-dev (installed with apt-get when missing)
sysdeps:
	@scripts/sysdeps.sh

# The series also applies with plain `patch -p1 --fuzz=0` and `quilt push -a`
# (tests/tooling/test_series.py runs both; this target is the manual check).
check-series: fetch
	rm -rf build/check && mkdir -p build/check
	cp -a "$$($(PYTHON) scripts/upstream.py unpack)" build/check/patch
	cp -a "$$($(PYTHON) scripts/upstream.py unpack)" build/check/quilt
	$(PYTHON) scripts/series.py check-patch build/check/patch
	$(PYTHON) scripts/series.py check-quilt build/check/quilt
	@echo "series applies with patch -p1 --fuzz=0 and quilt push -a"

# How the series applies to another release (scratch tree; nothing changes).
drift:
	@test -n "$(VERSION)" || { echo "usage: make drift VERSION=<sglang release>" >&2; exit 2; }
	$(PYTHON) scripts/drift.py $(VERSION)

# Carry the series to release X with git's 3-way merge (build/rebase/); stops
# at a conflict; writes patches/ and the pin only over committed files.
rebase:
	@test -n "$(VERSION)" || { echo "usage: make rebase VERSION=<sglang release>" >&2; exit 2; }
	$(PYTHON) scripts/rebase.py $(VERSION)

rebase-continue:
	$(PYTHON) scripts/rebase.py --continue

rebase-abort:
	$(PYTHON) scripts/rebase.py --abort

# The series table (docs/series.md), from the patch headers.
series-table:
	$(PYTHON) scripts/headers.py check
	$(PYTHON) scripts/headers.py table

# Extract one feature group as an upstream PR into build/pr/<feature>/.
# make pr formats the extracted tests with upstream's isort and ruff format.
pr: venv $(LINT_UPSTREAM)/.stamp
	@test -n "$(FEATURE)" || { echo "usage: make pr FEATURE=<series group>" >&2; exit 2; }
	$(VENV)/bin/python scripts/make_pr.py $(FEATURE)

# The PR's tests as upstream's CPU CI runs them, on the pinned release with
# that PR alone (build/pr-check/<feature>), and upstream's linters on the files
# the PR adds or changes.
pr-check: venv $(LINT_UPSTREAM)/.stamp
	@test -n "$(FEATURE)" || { echo "usage: make pr-check FEATURE=<series group>" >&2; exit 2; }
	$(VENV)/bin/python scripts/pr_check.py $(FEATURE)

# SMG, the gateway benchmark/cache_aware_routing/bench_vs_gateway.py compares
# with, in a venv of its own (the benchmark's; never the test venv).
GATEWAY_VENV ?= build/gateway-venv
GATEWAY_REQS := benchmark/cache_aware_routing/requirements-gateway.txt
gateway-venv: $(GATEWAY_VENV)/.stamp
$(GATEWAY_VENV)/.stamp: $(GATEWAY_REQS)
	$(PYTHON) -m venv $(GATEWAY_VENV)
	$(GATEWAY_VENV)/bin/python -m pip install -q --no-cache-dir -r $(GATEWAY_REQS)
	touch $@

clean:
	rm -rf build/src build/src.tmp build/wheel build/check dist

distclean: clean
	rm -rf build $(VENV)
