# The README's two commands. Both set up .venv from nothing on a fresh machine.
#   make demo   prepares a real text corpus and trains a small GPT on 8 CPU ranks
#               (tp=2 x pp=2 x dp=2), printing progress and the validation loss
#   make test   runs the whole test suite
#   make bench  prints the benchmarks' JSON lines (bench/)
#   make lint   ruff over the whole repository (pyproject's [tool.ruff.lint]); CI runs it first
#   make durations  runs the whole suite as make test does and records each module's seconds
#               in tests/durations.json (the slow-first order; docs/contributing.md)
# Override the torch requirement on a CUDA machine: make demo TORCH=torch
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
TEST_WORKERS ?= 2
BIN := $(VENV)/bin
export OMP_NUM_THREADS ?= 1

.PHONY: demo test lint durations bench setup clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

demo: setup
	$(BIN)/fxmeg prepare-data --input pydoc:topics --input stdlib:json --input stdlib:email \
		--output runs/demo/corpus
	$(BIN)/fxmeg train --config examples/demo.toml

# Two workers (pytest-xdist), one whole module at a time (its spawns are shared by its tests),
# slowest modules first (tests/durations.json, read by tests/conftest.py): the 2 cores stay
# busy to the end
PYTEST_SUITE := $(BIN)/python -m pytest tests -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
test: setup
	$(PYTEST_SUITE)

# The rules are pyproject's [tool.ruff.lint]; `$(BIN)/ruff check --fix .` sorts imports
lint: setup
	$(BIN)/ruff check .

# The same run, rewriting tests/durations.json if every test ran: commit it when the order
# it gives has moved (docs/contributing.md)
durations: setup
	$(PYTEST_SUITE) --record-durations

# Performance, one JSON line per benchmark (not part of the tests: timings are noisy)
bench: setup
	$(BIN)/python bench/pipeline.py
	$(BIN)/python bench/zero_bubble.py
	$(BIN)/python bench/overhead.py
	$(BIN)/python bench/data_parallel.py
	$(BIN)/python bench/bubble.py
	$(BIN)/python bench/p2p.py
	$(BIN)/python bench/compile.py
	$(BIN)/python bench/capture.py
	$(BIN)/python bench/plan.py
	$(BIN)/python bench/moe.py
	$(BIN)/python bench/fsdp.py
	$(BIN)/python bench/data.py
	$(BIN)/python bench/collectives.py

clean:
	rm -rf $(VENV) build *.egg-info
