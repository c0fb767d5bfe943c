# smolforge: two commands on a fresh machine, `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
BASE := $(VENV)/.installed-base
FULL := $(VENV)/.installed-test
# every test's duration goes to test-artifacts/junit.xml (git-ignored; CI keeps it): where the time goes
PYTEST := HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/python -m pytest -q --durations=25 --junitxml=test-artifacts/junit.xml
# Two pytest processes: the suite's time is process starts (a core idle ~40 % of it with one). Each takes
# whole work units, a module or the shared cluster's modules (tests/workunits.py `work_unit`). TEST_PROCS=0: one.
TEST_PROCS ?= 2
# --max-worker-restart=0: a pytest process that dies (a segfault in a native library) ends the run at once,
# naming the test it died in. pytest-xdist 3.8's loadgroup replaces a dead worker and then hangs, every
# worker idle, until CI's limit (pytest-dev/pytest-xdist#1323, #1327, #1378; seen here, stop 61).
PARALLEL := $(if $(filter 0,$(TEST_PROCS)),,-n $(TEST_PROCS) --dist loadgroup --max-worker-restart=0)
# llama.cpp for the GGUF export's verification: the library only (no tools, server, examples, tests
# or multimodal library, none of which the verification loads). pip caches the built wheel (whatever
# CMAKE_ARGS were: after changing them, `pip cache remove llama_cpp_python`).
# On x86-64 without AMX: llama.cpp's native build (-march=native) compiles its AMX kernels wherever the
# CPU has AMX, and on some such machines they segfault at the first matmul (ggml-org/llama.cpp#20824,
# PR #26954: the tile-data permission is asked on the main thread only, the kernels run on its workers).
# Here, a Sapphire Rapids VM: every llama.cpp test crashed its pytest process. GCC and clang keep an
# explicit -mno-* over -march=native whatever the order. bench/llama_server.py links these same libraries.
LLAMA_ARCH_FLAGS := $(if $(filter x86_64 amd64,$(shell uname -m)),-mno-amx-tile -mno-amx-int8 -mno-amx-bf16)
LLAMA_CMAKE_ARGS := -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \
	$(if $(LLAMA_ARCH_FLAGS),'-DCMAKE_C_FLAGS=$(LLAMA_ARCH_FLAGS)' '-DCMAKE_CXX_FLAGS=$(LLAMA_ARCH_FLAGS)')

.PHONY: demo test test-all install install-base bench clean

# What the demo needs: torch, from the pinned CPU build first (anything unpinned drags in GBs of CUDA
# packages), then smolforge itself.
$(BASE): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e .
	# gRPC stubs for split learning, generated from the .proto by the pinned grpcio-tools.
	$(BIN)/python -m smolforge.split.gen_proto
	touch $(BASE)

# The tests also need pytest and the real clients, llama-cpp-python (built from source: minutes, once)
# and offline W&B.
$(FULL): $(BASE)
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/pip install -q -c constraints.txt -e '.[test,export,wandb,eval,tabular]'
	# a wheel pip cached before LLAMA_ARCH_FLAGS would bring the AMX kernels back: stop here, saying how
	$(BIN)/python -c "import llama_cpp, sys; sys.exit(bool('$(LLAMA_ARCH_FLAGS)') and 'AMX' in llama_cpp.llama_print_system_info().decode() and 'make: llama-cpp-python was built with AMX kernels (a wheel pip cached earlier?); fix: $(BIN)/pip cache remove llama_cpp_python && $(BIN)/pip uninstall -y llama-cpp-python && make install')"
	touch $(FULL)

install-base: $(BASE)
install: $(FULL)

demo: $(BASE)
	$(BIN)/smolforge demo

# The CI tier: every test that is the only proof of a feature (what CI runs).
test: $(FULL)
	$(PYTEST) --tier ci $(PARALLEL) $(PYTEST_ARGS)

# The CI tier plus `soak` (second instances of recovery paths, long runs) and `bench` (speed and quality claims).
test-all: $(FULL)
	$(PYTEST) --tier all $(PARALLEL) $(PYTEST_ARGS)

bench: $(FULL)
	$(BIN)/python bench/train_throughput.py

clean:
	rm -rf $(VENV) build src/*.egg-info
