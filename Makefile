# The two quick-start commands (`make run`, `make test`) and the checks CI runs.
# Each target creates .venv with the first Python 3.11+ it finds and installs what it needs.

PYTHON ?= $(shell for p in python3.13 python3.12 python3.11 python3; do \
	command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
	2>/dev/null && { echo $$p; break; }; done)
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test check lint typecheck pytest docs openapi-types bench bench-quick bench-churn bench-budgets clean

$(BIN)/python:
	@test -n "$(PYTHON)" || { echo "make: Python 3.11 or newer is required (python3 --version)"; exit 2; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed-run: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e .
	@touch $@

# The tests also use the Python client, a distribution of its own (clients/python).
$(VENV)/.installed-test: pyproject.toml clients/python/pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test]' -e clients/python
	@touch $@ $(VENV)/.installed-run

## Start the service (API, docs page, workers) on http://127.0.0.1:8000, embedded PostgreSQL by default.
run: $(VENV)/.installed-run
	$(BIN)/turnstile serve

## Lint, type-check and run the whole test suite (TEST_DATABASE_URL, else an embedded PostgreSQL).
test: check pytest

check: lint typecheck

lint: $(VENV)/.installed-test
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: $(VENV)/.installed-test
	$(BIN)/mypy

# The suite in TEST_WORKERS processes, each test module in one of them (its module-scoped
# servers started once); TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= 3
pytest: $(VENV)/.installed-test
	@# Bytecode for the hundreds of processes the suite starts (workers, servers, the CLI):
	@# where PYTHONDONTWRITEBYTECODE is set, each would compile every module of app/ again.
	$(BIN)/python -m compileall -q app clients/python/src
	$(BIN)/pytest $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)

$(VENV)/.installed-docs: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[docs]'
	@touch $@ $(VENV)/.installed-run

## The docs site, offline, into site/ (open site/index.html): the README as its front page, docs/,
## and the HTTP API and CLI references generated from the code (scripts/docs_reference.py).
docs: $(VENV)/.installed-docs
	$(BIN)/python scripts/docs_reference.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

## The TypeScript client's API types (clients/typescript/src/openapi.ts), generated again from
## the server's OpenAPI document after a change to the API (needs node and npm).
openapi-types: $(VENV)/.installed-test
	cd clients/typescript && npm ci --no-audit --no-fund --loglevel=error
	$(BIN)/python clients/typescript/scripts/generate_types.py

$(VENV)/.installed-bench: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	@touch $@ $(VENV)/.installed-run

## The benchmark (a few minutes; TEST_DATABASE_URL or DATABASE_URL, else the embedded PostgreSQL):
## bench/results/latest.json and latest.md, docs/bench-latest.png. BENCH_QUICK=1: the quick mode.
## BENCH_PHASES=ceiling,api: those phases only (the API's scale curve beside the ceiling), in
## files of their own (latest-ceiling-api.json and .md).
bench: $(VENV)/.installed-bench
	$(BIN)/python bench/run.py $(if $(BENCH_QUICK),--quick,) $(if $(BENCH_PHASES),--phases $(BENCH_PHASES),)

## The quick mode (about a minute): bench/results/quick.json and quick.md, no PNG.
bench-quick: $(VENV)/.installed-bench
	$(BIN)/python bench/run.py --quick $(if $(BENCH_PHASES),--phases $(BENCH_PHASES),)

## Churn (opt-in, long: about an hour at the default 2,000,000 runs): runs enqueued, claimed,
## completed and pruned by retention through one database; the claim and the tables' sizes,
## dead tuples and HOT share along the way. CHURN_RUNS=N for another count;
## bench/results/churn-latest.json and .md.
bench-churn: $(VENV)/.installed-bench
	$(BIN)/python bench/churn.py $(if $(CHURN_RUNS),--runs $(CHURN_RUNS),)

## Model budgets (issue 39; a few minutes): a burst of 2,000 openai runs against an endpoint
## enforcing its own limits, with budgets and without; BUDGET_RUNS=N for another count,
## BENCH_QUICK=1 the quick mode; bench/results/budgets-latest.json and .md.
bench-budgets: $(VENV)/.installed-bench
	$(BIN)/python bench/model_budgets.py $(if $(BENCH_QUICK),--quick,) $(if $(BUDGET_RUNS),--runs $(BUDGET_RUNS),)

clean:
	rm -rf $(VENV) .turnstile .pytest_cache .mypy_cache .ruff_cache site docs/index.md docs/reference
	rm -rf clients/typescript/node_modules clients/typescript/dist
