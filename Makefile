# The README's commands. Each bootstraps .venv first (see deploy/bootstrap.sh).
SHELL := /bin/bash
BIN := .venv/bin
STAMP := .venv/.installed
PYTEST_ARGS ?=
# pytest-xdist workers, each taking whole modules (--dist loadfile): a module's shared fixture is set up once; in the
# order of tests/conftest.py (the paced cluster modules, then the longest tier first), not xdist's (the most tests
# first). `make test` has three: one runs the paced modules together (tests/conftest.py's PACED_MODULES: minutes of
# waiting at a fraction of a core), two the CPU-bound rest beside it.
TEST_WORKERS ?= 3
FAST_WORKERS ?= 2
DEMO_ARGS ?=

.PHONY: demo test test-fast test-gpu lint proto bench bootstrap data clean

$(STAMP): pyproject.toml constraints.txt
	deploy/bootstrap.sh venv

bootstrap: $(STAMP)

data:
	deploy/bootstrap.sh data

# With DEMO_ARGS="--data-dir DIR" the demo reads that directory and nothing is installed.
demo: $(STAMP)
	@case "$(DEMO_ARGS)" in *--data-dir*) ;; *) deploy/bootstrap.sh data;; esac
	$(BIN)/coordinator demo $(DEMO_ARGS)

test: $(STAMP)
	deploy/bootstrap.sh data prometheus
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# The unit and integration tiers (pyproject's markers): no cluster of agents, a few minutes.
test-fast: $(STAMP)
	deploy/bootstrap.sh data
	$(BIN)/python -m pytest -q -n $(FAST_WORKERS) --dist loadfile --no-loadscope-reorder -m "unit or integration" $(PYTEST_ARGS)

# The CUDA half of the suite (tests marked cuda), on a machine where torch sees a GPU; then the GPU benchmark.
test-gpu: $(STAMP)
	deploy/bootstrap.sh data
	$(BIN)/python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'make test-gpu: torch sees no CUDA device')"
	$(BIN)/python -m pytest -q -m cuda $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .

proto: $(STAMP)
	$(BIN)/python proto/generate.py nodeagent/_proto

bench: $(STAMP)
	deploy/bootstrap.sh data
	@set -e; for script in benchmarks/*.py; do echo "== $$script"; $(BIN)/python $$script; done

clean:
	rm -rf .venv .pytest_cache .ruff_cache runs
