# `make train` and `make test` do all set-up themselves: a virtual environment in .venv with the
# CPU build of torch 2.13.0 (on this machine's disk) unless a usable torch is already importable there.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.bigfit-installed

.PHONY: train test clean
train: $(STAMP)
	$(VENV)/bin/bigfit train $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

clean:
	rm -rf $(VENV) bigfit-out
