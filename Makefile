# nanopara: two commands do everything on a fresh machine
#   make train [NGPU=N] [ARGS="--key=value ..."]    set up, prepare data if missing, train
#              [RESTARTS=K [MIN_NGPU=M]]             restart after a crash, K times, with --resume (supervise.py)
#   make test                                        set up, run the whole suite (GPU tests skip on CPU machines)
#   make sample [RUN=runs/latest] [ARGS="--prompt=..."] text from a run's newest checkpoint (runs/latest: the last run)
# On a machine whose python already has torch/triton/tiktoken (e.g. the GPU machines): add PY=python3.

VENV    ?= .venv
PY      ?= $(VENV)/bin/python
NGPU    ?= 1
ARGS    ?=
# RESTARTS=K: nanopara/supervise.py starts the NGPU processes and, after a crash, starts them again with --resume,
# at most K times (0: no supervisor). MIN_NGPU=M < NGPU lets a restart continue on fewer GPUs when some stop answering
RESTARTS ?= 0
MIN_NGPU ?= $(NGPU)
DATASET ?= shakespeare
# train.py points runs/latest at the run it starts (runs/tiny on CPU, runs/default on a GPU)
RUN     ?= runs/latest
# The data mirror (tokenizer files, corpora) is looked up in one place, nanopara/data.py's default_mirror():
# MIRROR=DIR given here (exported as NANOPARA_MIRROR), else env NANOPARA_MIRROR, else ../shared/data beside the
# repository, else the public hosts. tiktoken's cache is the mirror's tiktoken_cache/ (data.get_tokenizer).
ifdef MIRROR
export NANOPARA_MIRROR := $(abspath $(MIRROR))
endif
HAS_GPU := $(shell $(PY) -W ignore -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null)
DEFAULT_PRESET := $(if $(filter 1,$(HAS_GPU)),gpt2_124m,tiny)
DEFAULT_DEVICE := $(if $(filter 1,$(HAS_GPU)),cuda,cpu)

.PHONY: setup train sft sample test test-gpu bench bench-all data plot lint clean

# the venv is only built when PY is the venv's python
$(VENV)/.done: pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q torch==2.13.0 || $(VENV)/bin/pip install -q torch
	@# a CPU build of torch brings no triton: take the version whose CPU interpreter we test against
	$(VENV)/bin/python -W ignore -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null || \
	  $(VENV)/bin/pip install -q triton==3.6.0
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

setup: $(if $(filter $(VENV)/bin/python,$(PY)),$(VENV)/.done,)

data: setup
	$(PY) data/prepare.py $(DATASET)

data/shards/%/.done:
	$(PY) data/prepare.py $*

# defaults only for what ARGS leaves out (a key repeated in ARGS: the last one wins, as everywhere)
TRAIN_ARGS = $(if $(findstring --preset=,$(ARGS)),,--preset=$(DEFAULT_PRESET)) \
             $(if $(findstring --device=,$(ARGS)),,--device=$(DEFAULT_DEVICE)) $(ARGS)

train: setup
	@ds=$$(echo "$(ARGS)" | sed -n 's/.*--data.dataset=\([^ ]*\).*/\1/p'); ds=$${ds:-$(DATASET)}; \
	  case "$$ds" in *.bin|*/*|*\**) ;; *) ls data/shards/$$ds/*train*.bin >/dev/null 2>&1 || \
	    $(PY) data/prepare.py $$ds || exit 1;; esac
ifneq ($(RESTARTS),0)
	$(PY) -m nanopara.supervise --restarts=$(RESTARTS) --nproc=$(NGPU) --min_nproc=$(MIN_NGPU) -- train.py $(TRAIN_ARGS)
else ifeq ($(NGPU),1)
	$(PY) train.py $(TRAIN_ARGS)
else
	@# one clear line for a bad configuration, instead of one per rank wrapped in torchrun's failure report
	@$(PY) train.py --check_world=$(NGPU) $(TRAIN_ARGS)
	$(PY) -m torch.distributed.run --standalone --nproc_per_node=$(NGPU) train.py $(TRAIN_ARGS)
endif

# supervised fine-tuning on a JSONL file of {"prompt", "response"} or {"messages"} lines (nanopara/sft.py), from a
# run directory or Hugging Face GPT-2 weights (INIT); ARGS come last, so they override the defaults here:
#   make sft JSONL=arith.jsonl INIT=runs/tiny ARGS="--preset=tiny --train.steps=300" [NGPU=N] [PREP_ARGS=--force]
SFT_SEQ  ?= 256
SFT_NAME ?= $(basename $(notdir $(JSONL)))
sft: setup
	@test -n "$(JSONL)" || { echo "make sft needs JSONL=FILE.jsonl (and INIT=RUN_DIR or a GPT-2 .bin)"; exit 2; }
	$(PY) data/prepare.py sft $(JSONL) --seq_len $(SFT_SEQ) --name $(SFT_NAME) $(PREP_ARGS)
	$(MAKE) train NGPU=$(NGPU) ARGS="--data.dataset=$(SFT_NAME) --train.seq_len=$(SFT_SEQ) \
	  $(if $(INIT),--ckpt.init_from=$(INIT),) --train.lr=1e-4 --train.warmup_steps=10 --train.val_every=50 \
	  --out_dir=runs/sft_$(SFT_NAME) $(ARGS)"

sample: setup
	$(PY) sample.py --out_dir=$(RUN) $(ARGS)

test: setup
	$(PY) -m pytest -q tests

test-gpu: setup
	$(PY) -m pytest -q -m gpu tests

# benchmarks on a GPU machine (bench/run_set.py), every file they write into OUT (default runs/bench):
#   make bench [OUT=DIR]                              the kernels against PyTorch, and GPT-2 124M's step
#   make bench-all [SET=all|kernels|e2e|layouts|fp8|moe|post_train|curves] [OUT=DIR]
bench: setup
	$(PY) bench/run_set.py kernels --out $(or $(OUT),runs/bench)

bench-all: setup
	$(PY) bench/run_set.py $(or $(SET),all) --out $(or $(OUT),runs/bench)

plot: setup
	@$(PY) -c 'import matplotlib' 2>/dev/null || $(PY) -m pip install -q matplotlib
	$(PY) bench/plot.py $(RUN)

lint: setup
	$(PY) -m compileall -q nanopara kernels train.py data tests bench

clean:
	rm -rf $(VENV) .pytest_cache
