# The README's two commands: `make demo` and `make test`. Both create .venv and install on first use.
# TORCH picks the torch build installed first (before the project, so its `torch>=2.5` range is already met):
# the default is the CPU wheel this project's CI machines carry; on a GPU cluster use e.g. `make TORCH=torch test`.
PYTHON ?= python3.11
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.install-stamp
PYTEST_ARGS ?=
# `make test SLOW=1` also runs the tests marked slow; `make test-gpu` runs the gpu-marked ones (needs CUDA).
MARKERS := $(if $(SLOW),not gpu,not slow and not gpu)
# `make test` runs the suite in TEST_WORKERS pytest-xdist processes (whole test files per process, so module
# fixtures are built once), each at TEST_THREADS torch/OpenMP threads: on the 2-core CI machines two single-threaded
# workers beat one two-threaded process (much of the suite is Python, MuJoCo and subprocess start-up; an AVX2-only
# AMD EPYC measured 24 min 45 s against 34 min 45 s). Files are handed out in collection order, which
# tests/conftest.py starts with the longest files (LONGEST_FIRST). A worker that dies (pytest-timeout ends a hung
# test's process, see pyproject.toml) fails the run instead of being replaced: xdist's replacement after a crash was
# seen idling forever with whole-file scheduling. `make test TEST_WORKERS=0` runs it in one process.
TEST_WORKERS ?= 2
TEST_THREADS ?= $(if $(filter 0,$(TEST_WORKERS)),,1)
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
	--max-worker-restart=0)

.PHONY: install demo test test-gpu lint format bench clean chromium

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || { echo "creating $(VENV) with $(PYTHON)"; $(PYTHON) -m venv $(VENV); }
	@$(PY) -c "import torch" 2>/dev/null || { \
		echo "installing $(TORCH) first: vla needs torch>=2.5, and this picks its build (the largest download and"; \
		echo "the longest step of the install; another build: make TORCH=... e.g. TORCH=torch on a GPU machine)"; \
		$(PY) -m pip install --progress-bar on "$(TORCH)"; }
	@echo "installing vla and its dependencies into $(VENV) (pip install -e '.[dev]')"
	$(PY) -m pip install -q -e ".[dev]"
	@# openpi's robot client for the serving compatibility tests; --no-deps: it pins numpy<2 but its code runs on
	@# numpy 2 and needs only msgpack and websockets, which the project has, and dm-tree (no dependencies of its
	@# own), which its ActionChunkBroker imports.
	$(PY) -m pip install -q --no-deps "openpi-client==0.1.2" "dm-tree==0.1.8"
	@touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/vla demo
	@echo "The vla command is installed in $(VENV)/bin: run 'source $(VENV)/bin/activate' to type 'vla ...' (or call $(VENV)/bin/vla)."

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The eval report's browser test loads the page in headless Chromium: Debian's package, installed when missing and
# run as root (otherwise that test skips and says so).
chromium:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			echo "installing Debian's chromium (apt-get) for the eval report's browser test"; \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
		else echo "chromium missing and not root: the eval report's browser test will skip"; fi; }

# Without a terminal (CI), TEST_DEADLINE (s) bounds the whole pytest run whatever hangs (pytest-timeout ends a hung
# test and tests/conftest.py kills processes the tests leaked; this is for anything else): `timeout` stops every
# process of the run, and make prints what each pytest process was running (tests/conftest.py's status files). The
# suite takes 10-17 min on the 2-core CI machines. At a terminal there is no deadline, so Ctrl-C reaches pytest
# (`timeout` would move the run out of the terminal's foreground process group). Whatever still carries the run's
# VLA_TEST_STATUS in its environment when pytest has ended (a process in a session of its own, which neither
# `timeout` nor a subreaper reaches) is killed and named, so nothing holds CI's output open.
TEST_DEADLINE ?= 2400
TEST_STATUS := .pytest_cache/vla-status
PYTEST_CMD = $(VENV)/bin/pytest -q -m "$(MARKERS)" $(XDIST) $(PYTEST_ARGS)

test: lint chromium
	@rm -rf $(TEST_STATUS) && mkdir -p $(TEST_STATUS)
	@echo '$(PYTEST_CMD)'
	@guard=""; { [ -t 0 ] && [ -z "$$CI" ]; } || guard="timeout --kill-after=30 $(TEST_DEADLINE)"; \
	$(if $(TEST_THREADS),OMP_NUM_THREADS=$(TEST_THREADS)) HF_HUB_OFFLINE=1 WANDB_MODE=offline MUJOCO_GL=egl \
		VLA_TEST_STATUS=$(CURDIR)/$(TEST_STATUS) $$guard $(PYTEST_CMD); rc=$$?; \
	if [ -n "$$guard" ] && { [ $$rc = 124 ] || [ $$rc = 137 ]; }; then \
		echo "make test: ended by TEST_DEADLINE=$(TEST_DEADLINE) s (or, for 137 before then, killed: see dmesg);"; \
		echo "each pytest process was then at:"; \
		for f in $(TEST_STATUS)/*.txt; do [ -f "$$f" ] && echo "  $$(basename $$f .txt): $$(cat $$f)"; done; \
	fi; \
	for f in $(TEST_STATUS)/*.leaks; do [ -f "$$f" ] && cat "$$f"; done; \
	for e in /proc/[0-9]*/environ; do \
		grep -qzx "VLA_TEST_STATUS=$(CURDIR)/$(TEST_STATUS)" "$$e" 2>/dev/null || continue; \
		p=$${e#/proc/}; p=$${p%/environ}; \
		echo "make test: killing pid $$p, left over from the run: $$(tr '\0' ' ' < /proc/$$p/cmdline | cut -c1-200)"; \
		kill -9 $$p 2>/dev/null; \
	done; \
	exit $$rc

# On a CUDA machine (with a CUDA torch build, e.g. `make TORCH=torch test-gpu`): CPU/GPU agreement, a bf16-autocast
# training step, compiled serving, masked grouped-query attention and `vla train` resuming on CUDA
# (tests/test_gpu.py); they skip, saying so, without CUDA.
test-gpu: $(STAMP)
	HF_HUB_OFFLINE=1 WANDB_MODE=offline MUJOCO_GL=egl $(VENV)/bin/pytest -q -m gpu $(PYTEST_ARGS)

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench: $(STAMP)
	$(PY) benchmarks/data_loader.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
