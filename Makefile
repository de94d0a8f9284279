# The two commands a newcomer types: `make demo` and `make test`.
# Both create .venv and install on first use; later runs skip the install
# unless pyproject.toml or constraints.txt changed. The demo installs the
# core and the `train` extra; the test targets add the `dev` extras (every
# other extra, the emulators, pytest, moto, ruff, mypy, playwright) on top.
# `make check` is the inner loop: lint, types and the unit tier only (no Ray,
# no S3 server, no Prefect API).
# The interpreter .venv is made with: PYTHON when given (`make demo PYTHON=python3.12`), else the first of PYTHONS
# that runs (a pyenv shim may be on PATH for a version it will not run); python3.11 first, the one CI and
# constraints.txt are for.
PYTHONS := python3.11 python3.12 python3.13
PYTHON ?= $(shell for p in $(PYTHONS); do $$p -c '' >/dev/null 2>&1 && { echo $$p; break; }; done)
NO_PYTHON := none of $(PYTHONS) runs here: install one, or name it (make demo PYTHON=/path/to/python3.12)
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
PIP    := $(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt
PYTEST_ARGS ?=
# The tests run where only 127.0.0.1 exists (a network namespace of their own; tests/loopback-only says so and
# runs them as before where that is not permitted): nothing they start may reach another address.
LOOPBACK_ONLY := tests/loopback-only

.PHONY: install install-dev demo test suite check lint typecheck unit bench clean

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || { test -n "$(PYTHON)" || { echo "$(NO_PYTHON)" >&2; exit 1; }; $(PYTHON) -m venv $(VENV); }
	$(PIP) -e '.[train]'
	@touch $(STAMP)

$(DEV_STAMP): $(STAMP)
	$(PIP) -e '.[dev]'
	@touch $(DEV_STAMP)

install: $(STAMP)

install-dev: $(DEV_STAMP)

demo: $(STAMP)
	$(BIN)/rayline demo

lint: $(DEV_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(DEV_STAMP)
	$(BIN)/mypy

# mypy runs beside the suite: its first, cacheless run on a fresh clone takes about a minute of one core,
# and the suite's start (servers, the unit tier) leaves room for it. Either failing fails `make test`.
test: lint
	@$(MAKE) --no-print-directory -j2 typecheck suite

# The MLflow model's test runs it in a virtualenv of its own requirements (no rayline): made here, where the package
# index is reachable, once per set of pins under .tools/mlflow-env (tests/mlflow_env.py).
suite: $(DEV_STAMP)
	$(BIN)/python -m tests.mlflow_env
	$(LOOPBACK_ONLY) $(BIN)/pytest $(PYTEST_ARGS)

unit: $(DEV_STAMP)
	$(LOOPBACK_ONLY) $(BIN)/pytest -m unit $(PYTEST_ARGS)

check: lint typecheck unit

bench: $(DEV_STAMP)
	$(BIN)/python bench/ingest.py
	$(BIN)/python bench/train.py
	$(BIN)/python bench/batch_inference.py
	$(BIN)/python bench/serve.py

clean:
	rm -rf $(VENV) rayline-data .pytest_cache .mypy_cache .ruff_cache
