# shipyard: the two commands people need are `make quickstart` and `make test`.
# Both install what they need into .venv first (pinned by requirements.lock).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
QS     := runs/quickstart

.PHONY: install quickstart test test-slow test-all lint format bench clean browse-screenshots

install: $(STAMP)

$(STAMP): pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c requirements.lock -e '.[dev]'
	# cuDNN for XLA:GPU's compile of fused attention (plan --target h100xN); --no-deps: its cuBLAS
	# dependency (0.5 GB) is a run-time library the compile-only GPU never loads.
	$(BIN)/python -m pip install --quiet --no-deps -c requirements.lock nvidia-cudnn-cu13
	touch $(STAMP)

# The whole pipeline on the embedded default corpus (the stdlib source), as the
# content-addressed pipeline src/shipyard/pipelines/quickstart.yaml: documents
# -> filter -> dedup -> BPE tokenizer -> token shards -> 600 steps of `tiny`
# -> held-out bits/byte vs a unigram baseline -> HF export -> a sample -> report.
# A second run skips every finished step.
quickstart: install
	$(BIN)/shipyard quickstart --root $(QS)

# The quick tier: every test not marked slow (docs/testing.md: tiers, by measured seconds); test-slow
# runs the rest, and CI both. JOBS=N spreads `make test` over N worker processes (pytest-xdist;
# tests/xdist_schedule.py: a module stays on one worker, the costliest start first); SLOW_JOBS the
# same for `make test-slow`. Measured on 2 cores (docs/testing.md): a second worker gained nothing
# for the quick tier before the split (its tests compile, and XLA keeps both cores busy) and 8:14
# against 9:22 in one run since, inside the noise; the slow tier's tests spend much of their time
# waiting on subprocesses, servers and clusters: 61:34 on one worker, 39:52 on two, 33:06 and 39:56
# on three (two CI runs; both cores then busy, so a fourth cannot help). Tests marked `solo` (a
# process's memory or timing under load) run after the workers, alone.
JOBS ?= 1
SLOW_JOBS ?= 3
xdist = $(if $(filter 1,$(1)),,-n $(1) --dist loadgroup)
# The slowest tests printed at the end (DURATIONS=0: all, what tools/durations_table.py reads).
DURATIONS ?= 30

test: install
	$(BIN)/python -m pytest -q -m "not slow" $(call xdist,$(JOBS)) --durations=$(DURATIONS)

test-slow: install
	$(BIN)/python -m pytest -q -m "slow and not solo" $(call xdist,$(SLOW_JOBS)) --durations=$(DURATIONS)
	$(BIN)/python -m pytest -q -m "slow and solo" --durations=$(DURATIONS)

# docs/browse/*.png, the screenshots docs/browse.md shows, taken by the browser tests themselves.
browse-screenshots: install
	SHIPYARD_BROWSE_SCREENSHOTS=docs/browse $(BIN)/python -m pytest -q tests/test_browse.py

test-all: install
	$(BIN)/python -m pytest -q

lint: install
	$(BIN)/ruff format --check src tests bench tools
	$(BIN)/ruff check src tests bench tools
	$(BIN)/python tools/check_docs.py

format: install
	$(BIN)/ruff format src tests bench
	$(BIN)/ruff check --fix src tests bench

bench: install
	$(BIN)/python bench/train_throughput.py
	$(BIN)/python bench/data_throughput.py
	$(BIN)/python bench/generate_throughput.py
	$(BIN)/python bench/moe_throughput.py

clean:
	rm -rf $(VENV) runs .pytest_cache
