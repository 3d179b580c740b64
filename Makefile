# bamba-harness: every target that needs Python creates .venv first (CPU machines). The GPU image cannot install
# anything, so the *-gpu targets run with the python3 that is already there.
PYTHON_BOOT ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# 2 workers match CI's 2 cores; override with `make test XDIST=auto`.
XDIST ?= 2
PYTEST_CPU := $(PY) -m pytest -n $(XDIST) --timeout=900
GPU_PY ?= python3

.PHONY: help venv test test-all test-slow test-gpu compare lm-eval clean

help:
	@echo "make compare   vendored engine vs the fp64 oracle on the bundled tiny model (table, JSON, PNG in out/compare)"
	@echo "make lm-eval   lm-eval tasks on the oracle, the vendored engine and transformers; accuracy/perplexity gate"
	@echo "make test      the CPU suite (not gpu, not slow), in parallel; creates .venv"
	@echo "make test-slow the slow CPU tests (fuzz, preemption, the vendored engine's generic scenario matrix)"
	@echo "make test-all  every CPU test, slow ones included"
	@echo "make test-gpu  the suite on a CUDA machine with the python3 that is there (no installs)"
	@echo "make clean     remove .venv and caches"

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON_BOOT) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: the CPU build on disk; anything unpinned would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	# the torch pin again, so that no extra's requirement can replace it
	$(PY) -m pip install -q -e '.[kernels,hf,test,plot,eval]' torch==2.13.0
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PYTEST_CPU) -m "not gpu and not slow" tests

test-slow: $(STAMP)
	$(PYTEST_CPU) -m "slow and not gpu" tests

test-all: $(STAMP)
	$(PYTEST_CPU) -m "not gpu" tests

# On the GPU image: the gpu-marked tests plus everything else that runs on CUDA when it is present.
test-gpu:
	$(GPU_PY) -m pytest -p no:cacheprovider -m "gpu and not slow" tests

# The main job: the vendored engine against the fp64 oracle on the bundled tiny model (table, JSON and PNG in out/).
# ssm_state_dtype-bfloat16 is left out while it fails on this model (README, Findings; pinned by a strict xfail).
COMPARE_SCENARIOS ?= batching,chunked_prefill,cudagraph,ssm_state_dtype-float32,tp,pp
compare: $(STAMP)
	$(VENV)/bin/bamba-harness compare --engine vendored --checkpoint fixtures/tiny-bamba --out out/compare \
		--scenarios $(COMPARE_SCENARIOS)

# lm-eval accuracy runs: the bamba_tiny tasks (fixtures/tasks) through the fp64 oracle, the vendored engine at a
# chunked-prefill budget and transformers; one table; fails when a candidate leaves the gate (fixtures/tasks/README.md).
# One torch thread: the tiny model's ops are too small to split, and two threads on a busy 2-core machine ran ~10x slower.
# 128 tokens per step: a step ends inside about one prompt in four (pieces continue in the next step); smaller budgets
# split every prompt but cost more steps (~1.3 s each under the Triton interpreter). The planted-fault run used 17.
LM_EVAL_BUDGET ?= 128
lm-eval: $(STAMP)
	OMP_NUM_THREADS=1 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 $(PY) -m harness.lm_eval_gate --out out/lm-eval \
		--candidate engine=vendored,max_num_batched_tokens=$(LM_EVAL_BUDGET) --candidate engine=transformers

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
