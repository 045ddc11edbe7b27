# Every target installs what it needs on first use (a .venv in the repo), so a fresh
# clone needs only Python 3.10+ and pip: `make train`, `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install train eval test test-slow test-gpu test-extras

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# make train ARGS="precision=16-mixed trainer.max_epochs=5"
train: $(STAMP)
	$(PY) train.py $(ARGS)

eval: $(STAMP)
	$(PY) eval.py $(ARGS)

test: $(STAMP)
	$(PY) -m pytest $(ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest -m slow $(ARGS)

test-gpu: $(STAMP)  # needs CUDA: every test is skipped without it
	$(PY) -m pytest -m gpu $(ARGS)

# Each extra of docs/fork.md's table, and all at once, deleted from a copy: the rest passes the
# tests and trains the default recipe (ARGS: names of extras to check, default all).
test-extras: $(STAMP)
	$(PY) .ci/extras.py $(ARGS)
