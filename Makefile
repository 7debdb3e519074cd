# viewmill — every target is one call to a Python module; `make help` lists them.
# Variables pass straight through; the Python modules hold the logic.

PYTHON   ?= python3
VENV     ?= .venv
PY       := $(VENV)/bin/python
DATASET  ?= synthetic
SRC      ?=
OUT      ?= data
METHOD   ?= rsa
GPUS     ?= 1
# NODES > 1: the same make command on every node, joined at RDZV=<host>:<port> (torchrun's c10d rendezvous);
# LAUNCHER=slurm submits NODES x GPUS as a SLURM job instead (ARGS: partition=... time_min=...)
NODES    ?= 1
RDZV     ?=
LAUNCHER ?= local
PRESET   ?=
ARGS     ?=
CKPT     ?=
LABELS   ?= 1%
INIT     ?=
RUNS     ?= runs
ENGINE   ?= local
# pytest-xdist processes for `make test` / `make test-fast` (2 fits 2 cores; more on a bigger machine)
TEST_PROCS ?= 2
SUDO     := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# The install stamp changes whenever the dependency pins change, so `make install` reinstalls then
# and is a no-op (seconds) otherwise.
STAMP    := $(VENV)/.installed-$(shell cat pyproject.toml requirements.lock 2>/dev/null | cksum | cut -d' ' -f1)
TEST_STAMP := $(subst .installed-,.installed-test-,$(STAMP))

.DEFAULT_GOAL := help
.PHONY: help install install-test demo docs test test-fast preprocess saliency saliency-check train eval linear finetune compare profile profile-compare bench-data bench-train bench-preprocess rehearse gpu-check

help:  ## list targets and variables
	@echo "viewmill make targets:"
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | awk -F'\t' '{printf "  make %-17s %s\n", $$1, $$2}'
	@echo "variables: DATASET=$(DATASET) (synthetic|cifar10|cifar100|imagefolder; train: any dataset under OUT)  SRC=$(SRC)  OUT=$(OUT)  ENGINE=$(ENGINE) (local|ray)"
	@echo "           METHOD=$(METHOD) (sdmp|relicv2|rsa|uota|dacl|byol|mocov3|simclr)  GPUS=$(GPUS) (per node)  NODES=$(NODES)  RDZV=$(RDZV)  LAUNCHER=$(LAUNCHER) (local|slurm)  PRESET=$(PRESET)  ARGS=\"key=value ...\"  CKPT=<checkpoint>"
	@echo "installed as a command: $(VENV)/bin/viewmill preprocess|train|eval|saliency|profile (viewmill COMMAND --help)"

install: $(STAMP)  ## system packages FFCV needs, .venv, the project (editable); idempotent

# uv installs the pinned packages (pip's resolver, one download and unpack at a time, took 3 of a fresh
# install's 3.4 minutes; uv about a third of that), without byte-compiling: Python compiles a module the
# first time a process imports it and keeps the byte code, so only what is used is compiled (a compileall
# of site-packages took 70 s of a fresh install; the suite and the demo import a small part of it).
PIP      := $(VENV)/bin/uv pip install -q --python $(PY) -c requirements.lock
# ... which needs Python allowed to write it: with PYTHONDONTWRITEBYTECODE set, every process compiled
# what it imported anew (`import torch` 17 s instead of 6 s on 2 cores).
unexport PYTHONDONTWRITEBYTECODE
define system_venv_torch
	@command -v pkg-config >/dev/null && pkg-config --exists libturbojpeg && pkg-config --exists opencv4 && pkg-config --exists libavdevice \
	  || { $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq pkg-config libopencv-dev libturbojpeg0-dev libavdevice-dev; }
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@test -x $(VENV)/bin/uv || $(PY) -m pip install -q -c requirements.lock uv
	$(PIP) "setuptools>=64" wheel numpy torch torchvision
endef

$(STAMP): pyproject.toml requirements.lock
	$(system_venv_torch)
	$(PIP) --no-build-isolation -e '.[test,profile,ffcv,dali]'
	@rm -f $(VENV)/.installed-* && touch $@

install-test: $(TEST_STAMP)  ## install, plus the optional extras the tests cover (Ray for ENGINE=ray, submitit, W&B, the peer loaders, the docs, the dense CRF)

# Straight to every extra (one pip run, not install's and then this one's): it also stands for install.
$(TEST_STAMP): pyproject.toml requirements.lock
	$(system_venv_torch)
	$(PIP) --no-build-isolation -e '.[test,profile,ffcv,dali,ray,slurm,wandb,peers,docs,crf]'
	@rm -f $(VENV)/.installed-* && touch $(STAMP) $@

demo: install  ## preprocess synthetic, pretrain dacl for a few CPU minutes, evaluate vs random init
	$(PY) -m preprocess --dataset synthetic --out $(OUT)
	$(PY) -m train method=dacl data=synthetic data.root=$(OUT) run.out_dir=$(RUNS) $(ARGS)

test: install-test  ## the whole test suite (what CI runs) in TEST_PROCS processes, with its 15 slowest tests
	$(PY) -m pytest -n $(TEST_PROCS) --dist worksteal --durations=15

docs: install-test  ## the documentation as a site in site/ (README as its home, API pages from the docstrings), warnings as errors
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet

test-fast: install-test  ## the test suite without tests marked slow or ddp (the inner loop: under 3 minutes)
	$(PY) -m pytest -n $(TEST_PROCS) --dist worksteal -m "not slow and not ddp"

preprocess: install  ## DATASET, SRC, OUT → FFCV + DALI files and manifest; resumes; ENGINE=ray (ARGS: more options)
	$(if $(filter ray,$(ENGINE)),@$(MAKE) --no-print-directory install-test)
	$(PY) -m preprocess --dataset $(DATASET) $(if $(SRC),--src $(SRC)) --out $(OUT) --engine $(ENGINE) $(ARGS)

train: install  ## pretrain METHOD on DATASET (PRESET: data preset; GPUS>1: DDP processes per node; NODES, RDZV, LAUNCHER=slurm), then kNN + linear probe
	$(PY) -m train gpus=$(GPUS) nodes=$(NODES) $(if $(RDZV),rdzv=$(RDZV)) launcher=$(LAUNCHER) method=$(METHOD) data=$(DATASET) $(if $(PRESET),preset=$(PRESET)) data.root=$(OUT) run.out_dir=$(RUNS) $(ARGS)

saliency: install  ## saliency masks for a written dataset (both formats) + reports/saliency-<DATASET>/ (INIT: a run's backbone)
	@$(PY) -c "import pydensecrf.densecrf" 2>/dev/null || $(PIP) --no-build-isolation pydensecrf2
	$(PY) -m preprocess.saliency --dataset $(DATASET) --root $(OUT) $(if $(INIT),--init $(INIT)) $(ARGS)

saliency-check: install  ## after make saliency: relicv2 with p_m 0, 0.1 on the masks, 0.1 on centred rectangles (ARGS: steps=, seeds=)
	$(PY) -m preprocess.saliency.control --dataset $(DATASET) --root $(OUT)
	$(PY) -m bench.saliency_check dataset=$(DATASET) data.root=$(OUT) run.out_dir=$(RUNS) $(ARGS)

eval: install  ## kNN + linear probe of CKPT's backbone against random init
	$(PY) -m train eval ckpt=$(CKPT) $(ARGS)

linear: install  ## the papers' linear evaluation of CKPT (top-1/top-5; GPUS, NODES, LAUNCHER=slurm; ARGS: preset=, compare=random_init, epochs=, ...)
	$(PY) -m train gpus=$(GPUS) nodes=$(NODES) $(if $(RDZV),rdzv=$(RDZV)) launcher=$(LAUNCHER) linear ckpt=$(CKPT) $(ARGS)

finetune: install  ## semi-supervised fine-tuning of CKPT on LABELS (1%, 10%, or a file listing the labelled images) (ARGS: preset=, ...)
	$(PY) -m train gpus=$(GPUS) nodes=$(NODES) $(if $(RDZV),rdzv=$(RDZV)) launcher=$(LAUNCHER) finetune ckpt=$(CKPT) labels=$(LABELS) $(ARGS)

compare: install  ## METHOD beside the baseline its paper compares it with, all else equal, over seeds (ARGS: seeds=, steps=, against=, key=value)
	$(PY) -m bench.compare method=$(METHOD) data=$(DATASET) $(if $(PRESET),preset=$(PRESET)) data.root=$(OUT) $(ARGS)

profile: install-test  ## throughput report: loader stages vs baseline, peers (lightly, SPDL) and ceilings, first batch, epoch boundaries, training steps, scaling
	$(PY) -m bench.profile $(if $(filter command line environment,$(origin DATASET)),--dataset $(DATASET)) \
	  $(if $(RECIPES),--recipes $(RECIPES)) $(if $(METHODS),--methods $(METHODS)) \
	  $(if $(BACKENDS),--backends $(BACKENDS)) $(if $(QUICK),--quick) $(if $(TRACE),--trace) $(ARGS)

profile-compare: install  ## ratios between two profile reports: make profile-compare A=reports/profile-... B=...
	$(PY) -m bench.profile compare $(A) $(B) $(ARGS)

bench-data: install-test  ## data pipelines alone: backends vs torchvision baseline, peers (lightly, SPDL) and decode ceilings
	$(PY) -m bench.data $(ARGS)

bench-train: install  ## training steps/s, images/s, memory, accuracy per objective (ARGS="minutes=12": the table of docs/measured.md)
	$(PY) -m preprocess --dataset synthetic --out $(OUT)
	$(PY) -m bench.train data.root=$(OUT) run.out_dir=$(RUNS) $(ARGS)

bench-preprocess: install-test  ## preprocessing throughput (images/s), 1 worker and all cores
	$(PY) -m bench.preprocess $(ARGS)

rehearse: install-test  ## ImageNet's shape with tiny pixels: 1.28 M records, 1,282 shards, 8 gloo ranks, kills, ulimit -n 1024 (ARGS: --scale, --stages)
	$(PY) -m bench.rehearse $(ARGS)

gpu-check: install  ## on a GPU machine: gpu tests, DALI GPU vs CPU graph vs torchvision, ResNet-50 data stall
	$(PY) -m bench.gpu_check $(ARGS)
