# Every target installs what it needs on first use (a .venv in the repo), so a fresh
# clone needs only Python 3.10+ and pip: `make train`, `make test`. Two stamps: training needs
# the package and its dependencies; the tests also need pytest and the extras' optional packages.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TRAIN_STAMP := $(VENV)/.installed-train
STAMP  := $(VENV)/.installed

.PHONY: install train eval test test-slow test-avx2 test-gpu test-extras bench-gpu rename

$(TRAIN_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	touch $(TRAIN_STAMP)

$(STAMP): $(TRAIN_STAMP)
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

# make train ARGS="precision=16-mixed trainer.max_epochs=5"
train: $(TRAIN_STAMP)
	$(PY) train.py $(ARGS)

eval: $(TRAIN_STAMP)
	$(PY) eval.py $(ARGS)

test: $(STAMP)
	$(PY) -m pytest $(ARGS)

# Every core too: each test starts processes of its own (commands, DDP ranks, sweeps) and
# waits on them, so two tests at a time overlap one's imports with the other's training.
test-slow: $(STAMP)
	$(PY) -m pytest -m slow $(ARGS)

# The tests whose answer depends on the CPU's bfloat16/float16 instructions (marker `native`),
# with oneDNN and ATen capped at AVX2 as on an AVX2-only server or laptop: `make test` runs them
# with this CPU's own, so CI sees both answers on any box.
test-avx2: $(STAMP)
	ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 $(PY) -m pytest -m "native and not slow and not gpu" $(ARGS)

test-gpu: $(STAMP)  # needs CUDA: every test is skipped without it
	$(PY) -m pytest -m gpu $(ARGS)

# Every extra (a folder of src/cifar_amp/extras/, and bench/) comes off whole: a copy without
# any passes the core's tests, a copy of the core and one extra its tests; a copy without one
# extra trains the default recipe and evaluates it, or stops in one line naming the extras that
# need it (ARGS: extras to check, default all).
test-extras: $(STAMP)
	$(PY) .ci/extras.py $(ARGS)

# Every GPU promise of the template in one command, one table (bench/gpu.py), written into
# docs/benchmarks-gpu.md's record section. No venv is needed: on a GPU machine that has torch,
# torchvision, lightning and torchmetrics but no network,
#   make bench-gpu PYTHON=python3 WHEELS=<folder of Hydra's wheels> [DATA=<CIFAR-10 folder>]
#                  [AIRBENCH=<airbench94.py>] [ARGS="--budget 600 ..."]
# installs Hydra's three wheels into .bench-site/ and runs with PYTHONPATH=src:. (the venv's
# python is used where `make install` made one). Without CUDA it is a dry run at tiny sizes.
BENCH_PY := $(if $(wildcard $(PY)),$(PY),$(PYTHON))
bench-gpu:
	$(if $(WHEELS),$(BENCH_PY) -m pip install -q --no-index --no-deps --target .bench-site $(WHEELS)/*.whl &&) \
	PYTHONPATH=src:.$(if $(WHEELS),:.bench-site)$${PYTHONPATH:+:$$PYTHONPATH} \
	$(BENCH_PY) -m bench.gpu $(if $(DATA),--data-dir $(DATA)) $(if $(AIRBENCH),--airbench $(AIRBENCH)) $(ARGS)

# make rename NAME=<your_pkg>: the package, its module paths in configs, code, tests and docs, the
# distribution, and the checkpoints in tests/ (rewritten through torch.load, not as bytes). The
# next target reinstalls the package under its new distribution name.
rename: $(TRAIN_STAMP)
	$(if $(NAME),,$(error make rename NAME=<your_pkg>))
	$(PY) scripts/rename.py $(NAME)
	rm -f $(TRAIN_STAMP) $(STAMP)
