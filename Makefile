# memledger: every target does its own set-up (a fresh clone needs nothing run first).
.DEFAULT_GOAL := help
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# The suite's worker processes (pytest-xdist): every test has its own database, Redis
# database per worker and temporary files, so they run side by side. PYTEST_WORKERS=0
# runs it in one process (pytest's own -n 0).
PYTEST_WORKERS ?= 2

.PHONY: help install lint test test-fast test-langgraph demo demo-workers bench bench-quick bench-plot eval clean

help: ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-14s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,bench,server]'
	@touch $(STAMP)

install: $(STAMP) ## create .venv and install memledger with its dev tools

lint: $(STAMP) ## ruff and mypy (strict) on the packages
	$(BIN)/ruff check memledger ledger projections workers replay tests examples bench
	$(BIN)/mypy
	$(BIN)/lint-imports

test: $(STAMP) ## the whole suite (PostgreSQL and Redis tests skip without the servers, fail when CI=true)
	$(BIN)/pytest -n $(PYTEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

test-langgraph: $(STAMP) ## LangGraph's and langgraph-sdk's own store tests (fetched at test time) against memledger.langgraph and memledger serve
	rc=0; $(BIN)/python tests/peer/run_langgraph.py $(PYTEST_ARGS) || rc=1; \
	$(BIN)/python -m tests.peer.run_langgraph_sdk $(PYTEST_ARGS) || rc=1; exit $$rc

test-fast: $(STAMP) ## the suite without the slow integration tests
	$(BIN)/pytest -n $(PYTEST_WORKERS) --dist worksteal -m 'not slow' $(PYTEST_ARGS)

demo: $(STAMP) ## the after-sales story on the embedded SQLite default
	$(BIN)/python examples/demo.py

demo-workers: $(STAMP) ## the same story through publish and a worker daemon (needs Redis)
	$(BIN)/python examples/demo.py --workers

bench: $(STAMP) ## benchmarks, each beside raw sqlite3 doing the same work in the same run
	$(BIN)/python -m bench

bench-quick: $(STAMP) ## the same benchmarks at small sizes, a smoke run (under 2 minutes)
	$(BIN)/python -m bench --quick

bench-plot: $(STAMP) ## docs/bench-ratios.png from bench-out/results.json (BEFORE=file.json adds a before run)
	$(BIN)/python -m bench.plot $(if $(BEFORE),$(BEFORE):before) bench-out/results.json:after --out docs/bench-ratios.png

eval: $(STAMP) ## recall quality on LoCoMo (dev split) beside BM25 and dense baselines, and the bilingual fixture
	$(BIN)/python -m bench.eval

clean: ## remove the venv and caches
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
