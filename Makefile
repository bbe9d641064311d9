# `make train` and `make test` do all set-up themselves: a virtual environment in .venv with the
# CPU build of torch 2.13.0 (on this machine's disk) unless a usable torch is already importable there.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.bigfit-installed

.PHONY: train test clean
train: $(STAMP)
	$(VENV)/bin/bigfit train $(ARGS)

# Two pytest workers, each test file on one of them (its module fixtures, the rank pools, run once):
# on 2 cores the suite ran 10 min 28 s against 12 min 52 s in one process (2026-12-05), whose rank
# pools and subprocesses leave a core idle about a third of the time. The suite starts some hundred
# Python processes: bigfit's modules are compiled once here (only those changed since), not in each
# of them where PYTHONDONTWRITEBYTECODE is set (1.1-1.4 s of CPU a process that imports the training stack).
# Files go to the workers in collection order, the longest first (tests/conftest.py LONGEST), not
# xdist's order by number of tests, which started the longest files last.
test: $(STAMP)
	$(PY) -m compileall -q src tests > /dev/null
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder $(ARGS)

# pip shows its own progress (each package it fetches, a bar for the large ones on a terminal): on a
# fresh clone these steps take minutes, which `pip install -q` spent saying nothing.
PIP := $(PY) -m pip install --disable-pip-version-check
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) "torch==2.13.0"
	$(PIP) -e ".[test]"
	touch $@

clean:
	rm -rf $(VENV) bigfit-out
