# ringfeed: a fresh clone needs only `make demo` and `make test`; both run `make setup` first.
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
PYTEST_ARGS ?=
TEST_WORKERS ?= 2 # make test: pytest-xdist workers (each file on one; tests/conftest.py groups them)
IMAGE_CHECK_ARGS ?=   # make image-check: any of cpu gpu-recipe apptainer-recipe (default: all)

.PHONY: setup test test-fast demo demo-lm lint bench gpu-kit gpu-check image-check clean

setup:            ## create .venv, install the pinned stack, build/cache Horovod (idempotent)
	@PYTHON=$(PYTHON) bash docker/install.sh $(VENV)

test: setup       ## the whole suite (what CI runs), on TEST_WORKERS workers
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --no-loadscope-reorder $(PYTEST_ARGS)

test-fast: setup  ## the unit tier (no subprocess, no server): what to run while editing
	$(BIN)/python -m pytest -q -m "not integration and not system" $(PYTEST_ARGS)

demo: setup       ## the main job: digits -> shards -> 2-rank Horovod training, torch then TF
	$(BIN)/python examples/demo.py

demo-lm: setup    ## byte-level token shards from Python's own sources -> small GPT, 2 ranks
	$(BIN)/python examples/demo.py --lm

lint: setup
	$(BIN)/ruff check .

bench: setup      ## all benchmarks, full mode; results under benchmarks/results/
	$(BIN)/python benchmarks/run_all.py

gpu-kit: setup    ## pack what gpu-check needs on a GPU machine without network into .gpu/
	VENV=$(VENV) bash docker/gpu_kit.sh

gpu-check:        ## on a GPU machine: Horovod+NCCL build, GPU demo (fp32/bf16/fp16), benchmark
	bash docker/gpu_check.sh

image-check:      ## by hand, root, ~25 min cold: build ringfeed:cpu with podman, run it (demo, 2 hosts, compose); GPU/Apptainer recipes as far as they run
	bash docker/image_check.sh $(IMAGE_CHECK_ARGS)

clean:
	rm -rf demo-out runs .pytest_cache
