# Two entry points on a fresh machine: `make demo` and `make test`. Each creates .venv itself and
# installs through constraints.txt, which pins torch to the local CPU build. `make demo` installs the
# package and its runtime dependencies only; `make test` adds the test and dev extras (megatron-core,
# lightning, transformers, moto, ruff, ...) and Azurite.
VENV ?= .venv
PY := $(VENV)/bin/python
RUNTIME_STAMP := $(VENV)/.installed-runtime
STAMP := $(VENV)/.installed

.PHONY: demo demo-reshard test reliability lint bench-plan clean

$(RUNTIME_STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e .
	touch $(RUNTIME_STAMP)

$(STAMP): $(RUNTIME_STAMP)
	$(PY) -m pip install -q -c constraints.txt -e ".[test,dev]"
# Azurite (Azure Blob emulator) for the object-store tests; without npm those tests are skipped
	if command -v npm >/dev/null 2>&1; then npm install --silent --no-save --no-audit --no-fund --prefix $(VENV)/azurite azurite@3.35.0 || echo "warning: npm could not install azurite: the Azure tests will be skipped"; else echo "warning: npm not found: the Azure tests will be skipped"; fi
	touch $(STAMP)

# the demo's checkpoints and its export stay in demo-output/ (cleared first: the demo resumes from what it finds)
DEMO_DIR := demo-output

demo: $(RUNTIME_STAMP)
	rm -rf $(DEMO_DIR)
	$(PY) examples/train_demo.py --workdir $(DEMO_DIR)

demo-reshard: $(RUNTIME_STAMP)
	$(PY) examples/reshard_demo.py

test: $(STAMP)
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -n 2 --dist loadgroup -m "not bench_smoke" tests

# every benchmark script in its quick mode, end to end, its output parsed (part of `make reliability`)
.PHONY: test-bench
test-bench: $(STAMP)
	$(PY) -m pytest -n 2 -m bench_smoke tests

# kill -9, corruption, metadata fuzzing, racing jobs, the step manager, hostile foreign checkpoints,
# node losses and processes that exit right after a load, dozens to hundreds of trials each, then the
# benchmark smoke runs (make test-bench); `make test` runs a fast seeded subset of the same campaigns
reliability: $(STAMP)
	$(PY) -m tests.reliability --full
	$(PY) -m pytest -n 2 -m bench_smoke tests

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/lint-imports

bench-plan: $(STAMP)
	$(PY) benchmarks/bench_planner.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis $(DEMO_DIR)

# I/O benchmarks: shardsafe against DCP, torch.save, safetensors and the raw limit, in one run
.PHONY: bench bench-quick
BENCH_STAMP := $(VENV)/.installed-bench
$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e ".[test,dev,bench]"
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(PY) benchmarks/bench_io.py --update-docs

bench-quick: $(BENCH_STAMP)
	$(PY) benchmarks/bench_io.py --quick

# Object-store benchmark: shardsafe against DCP's FsspecWriter/FsspecReader over s3fs, same local S3 server
.PHONY: bench-s3
bench-s3: $(BENCH_STAMP)
	$(PY) benchmarks/bench_object_store.py

# Async save: time the training loop is blocked, step slowdown with a save in flight, time to
# durable; shardsafe's async_save against DCP's async saves and a memcpy, on 2 and 4 ranks
.PHONY: bench-async bench-async-quick
bench-async: $(BENCH_STAMP)
	$(PY) benchmarks/bench_async.py --update-docs

bench-async-quick: $(BENCH_STAMP)
	$(PY) benchmarks/bench_async.py --quick

# Megatron-style 4-rank TP2 x DP2 save, load and resharding load: shardsafe.megatron against
# megatron-core's dist_checkpointing (torch_dist, plain and fully parallel)
.PHONY: bench-megatron bench-megatron-quick
bench-megatron: $(BENCH_STAMP)
	$(PY) benchmarks/bench_megatron.py --update-docs

bench-megatron-quick: $(BENCH_STAMP)
	$(PY) benchmarks/bench_megatron.py --quick

# DCP plugin and DCP import: dcp.save/dcp.load through our StorageWriter/StorageReader against
# DCP's FileSystemWriter/FileSystemReader and Checkpointer, and shardsafe.dcp.convert
.PHONY: bench-dcp
bench-dcp: $(BENCH_STAMP)
	$(PY) benchmarks/bench_dcp.py --update-docs

# Hugging Face export and load_hf_safetensors (FSDP2 on 2 and 4 ranks, TP on 2) against
# unshard + safetensors.save_file, safetensors.load_file + distribute_tensor and the raw read limit
.PHONY: bench-hf bench-hf-quick
bench-hf: $(BENCH_STAMP)
	$(PY) benchmarks/bench_hf.py --update-docs

bench-hf-quick: $(BENCH_STAMP)
	$(PY) benchmarks/bench_hf.py --quick

# Tensor subclasses (issue 25): save and load with torchao's 8-bit optimizer state against plain
# AdamW state, per byte of checkpoint, shardsafe and DCP in one run, at 16, 64 and 256 MiB weights;
# the marginal cost of a byte from the last two (fixed costs cancel); one SUBCLASS line (about 8 min)
.PHONY: bench-subclasses
bench-subclasses: $(STAMP)
	$(PY) benchmarks/bench_subclasses.py --width 2048 --wide 4096 8192

# The memory tier (issue 24): save blocking vs memcpy, time to safe vs a raw send, restore after a
# node loss from peers' memory vs from the durable tier read cold; one MEMTIER line
.PHONY: bench-memory bench-memory-gpu bench-memory-quick
bench-memory: $(STAMP)
	$(PY) benchmarks/bench_memtier.py --nodes 4 --mib-per-rank 256

bench-memory-gpu: $(STAMP)
	$(PY) benchmarks/bench_memtier_gpu.py --mib 256

bench-memory-quick: $(STAMP)
	$(PY) benchmarks/bench_memtier.py --nodes 3 --mib-per-rank 16 --steps 3

# Megatron-Core v0.15.3's own tests/unit_tests/dist_checkpointing suite on CPU/gloo (8 ranks), against
# shardsafe.megatron installed as megatron.core.dist_checkpointing and against real megatron-core;
# prints MEGATRON-TESTS lines. Not part of `make test`: it needs Megatron-LM's sources, which CI cannot
# fetch (git clone --depth 1 --branch core_v0.15.3 https://github.com/NVIDIA/Megatron-LM $(MEGATRON_SRC)).
# MEGATRON_TESTS=... picks files (e.g. "test_mapping.py test_serialization.py", or --all for every file, models/ too).
.PHONY: test-megatron
MEGATRON_SRC ?=
MEGATRON_TESTS ?=
test-megatron: $(STAMP)
	$(PY) tests/megatron_suite/run.py --megatron-src "$(MEGATRON_SRC)" $(MEGATRON_TESTS)
