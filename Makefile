# smolforge: two commands on a fresh machine, `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# torch first, from the pinned CPU build: anything unpinned drags in GBs of CUDA packages.
	$(BIN)/pip install -q -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[test,export,wandb]'
	# gRPC stubs for split learning, generated from the .proto by the pinned grpcio-tools.
	$(BIN)/python -m smolforge.split.gen_proto
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/smolforge demo

test: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(BIN)/python -m pytest -q --durations=20 $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python bench/train_throughput.py

clean:
	rm -rf $(VENV) build src/*.egg-info
