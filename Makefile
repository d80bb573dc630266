# The two commands: `make demo` runs the whole pipeline, `make test` runs the suite.
# Both create .venv on first use; constraints.txt pins torch to the CPU build available here.
# The local Hub speaks Xet like the real one, so the client uploads through Xet (hf_xet) by default;
# HF_HUB_DISABLE_XET=1 in the environment selects the legacy LFS path instead.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
export HF_HUB_DISABLE_TELEMETRY := 1

.PHONY: demo test lint bench mutate venv clean-runtime

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -qq --disable-pip-version-check -c constraints.txt -e '.[test,card,sign,localhub,datasets,traces]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) scripts/demo.py

# Two workers, one thread each: most tests start real training processes, so the suite
# is bound by interpreter starts and fits both cores without oversubscribing them.
# loadgroup: a module marked xdist_group (test_distributed) shares its launches on one worker.
test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadgroup

# Mutation score (not part of `make test`): plant each defect of tests/mutation/*.toml alone in a
# scratch copy, run the tests named for it, report the kill rate and the survivors.
mutate: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) tests/mutation/mutate.py

# Lint, import order and formatting (ruff, configured in pyproject.toml); .ci/run runs it before the tests.
# `$(PY) -m ruff format .` rewrites what the last line refuses.
lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# Side by side, ratios with targets (benchmarks/README.md): checkpoints at 0.06, 0.6 and 3 GB,
# in one process and under torchrun (2 processes), publishing, staging memory, the input pipeline,
# the training step against a plain loop and transformers' Trainer.
bench: $(STAMP)
	$(PY) -m pip install -qq --disable-pip-version-check -c constraints.txt -e '.[bench]'
	$(PY) benchmarks/checkpoint.py --sizes 0.06,0.6,3 --reps 3
	$(PY) benchmarks/disk_state.py
	$(PY) benchmarks/distributed.py --sizes 0.06,0.6,3 --reps 3
	$(PY) benchmarks/publish.py
	$(PY) benchmarks/stage_memory.py --nproc 2
	$(PY) benchmarks/stage_memory.py --nproc 1
	$(PY) benchmarks/dataloader.py
	$(PY) benchmarks/throughput.py
