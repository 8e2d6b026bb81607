# kvshuttle — the two commands a fresh machine needs are `make demo` and `make test`.
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
BUF := npx --yes @bufbuild/buf
PROTOS := $(shell find proto -name '*.proto' | sort)
GEN_OUT := services

.PHONY: help venv vllm up demo-registry proto proto-check lint typecheck docs test quick unit deploy-check demo bench load bench-cluster bench-fleet chaos flake-hunt profile clean

help:
	@echo "make demo   - real vLLM prefill/decode + kvshuttle: an agent session, TTFT with and without reuse"
	@echo "              REGISTRY_STORE=redis: the registry's state in a local Redis (valkey-server from the venv)"
	@echo "              OTLP_ENDPOINT=http://host:4317 (demo and up): one trace per turn, vLLM's spans included"
	@echo "make up     - real vLLM prefill/decode + every kvshuttle service, up until Ctrl-C: an OpenAI endpoint"
	@echo "              for your own client (MODEL=DIR: a local Hugging Face model; STORE=redis; GATEWAY_PORT=8080)"
	@echo "make demo-registry - the registry alone, driven by the kvshuttle CLI"
	@echo "make test   - buf lint/format, generated-code freshness, ruff, import layers, mypy, deploy-check, docs, pytest (real vLLM included)"
	@echo "make quick  - lint, types, docs and every test that needs no real vLLM and runs no failover scenario (about two minutes here)"
	@echo "make docs   - the docs site (mkdocs, Material), built strictly into .run/site: broken links and missing pages fail"
	@echo "make deploy-check - render the Kubernetes overlays (kubectl kustomize), validate them (Kubernetes 1.32 and the vendored Gateway API CRDs, strict), test them"
	@echo "make vllm   - install the CPU build of vLLM into .venv-vllm (done by make test and demo)"
	@echo "make proto  - regenerate Python code from proto/"
	@echo "make profile MODEL=Qwen/Qwen3-32B GPU=h200_sxm TP=2 - an engine profile from aiconfigurator (deploy/profiles/)"
	@echo "make bench  - run the benchmarks under bench/ (results in bench/results/)"
	@echo "make load   - the bounded load run over stand-in engines (LOAD_ARGS=--full: 10k turns per configuration)"
	@echo "make bench-cluster - every routing policy side by side on an emulated 8P+8D cluster, Mooncake and agent traces, <= 20 min (CLUSTER_ARGS=--quick: a small one)"
	@echo "make bench-fleet   - the fleet simulator: every policy incl. llm-d and Dynamo as they ship, Mooncake, Claude Code and agent traces, 8P+8D, virtual time (FLEET_ARGS=--quick: a small one)"
	@echo "make flake-hunt - the suite on a loaded machine: 3 runs beside a CPU burner (one with make demo beside it),"
	@echo "              then the tests that wait on processes, signals, timers or failovers 10 times; a tally"
	@echo "              in .run/flake-hunt/ (HUNT_ARGS='--suite-runs 1 --repeat 3' etc.; hours with the defaults)"
	@echo "make chaos  - the chaos suite: faults under a conversation workload on real vLLM (table and"
	@echo "              bench/results/chaos-*.json; CHAOS_MARKERS='chaos and not slow' skips the engine restart)"

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

venv: $(BIN)/.installed

# Real vLLM (CPU build) in its own venv, with kvshuttle's vLLM plugin: idempotent, seconds when done.
vllm:
	bash deploy/vllm/install.sh

# NIXL for the agent's block pool, as deploy/vllm/install.sh does for vLLM's venv: both wheels
# --no-deps (else several GB of torch/CUDA); `nixl` is the meta wheel that provides `nixl._api`.
NIXL_SPECS := nixl-cu12==1.5.1 nixl==1.5.1

# xds-protos ships an older opentelemetry/proto/common/v1/common_pb2.py over opentelemetry-proto's
# (no InstrumentationScope): the OTLP exporter, so every service, would fail to import. Put the
# installed opentelemetry-proto's files back, then check the exporter imports.
OTEL_PROTO_VERSION = $$($(BIN)/python -c 'from importlib.metadata import version; print(version("opentelemetry-proto"))')

$(BIN)/.installed: $(BIN)/python pyproject.toml Makefile
	$(BIN)/pip install -q -e '.[dev]'
	$(BIN)/pip install -q --force-reinstall --no-deps "opentelemetry-proto==$(OTEL_PROTO_VERSION)"
	$(BIN)/python -c 'from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter'
	$(BIN)/pip install -q --no-deps $(NIXL_SPECS)
	$(BIN)/python -c 'import nixl._api'
	touch $@

# Python messages, grpc stubs and .pyi stubs, all from grpcio-tools + mypy-protobuf (pinned in
# pyproject.toml). Writes the whole generated tree under the directory in the shell variable $out.
GEN = $(BIN)/python -m grpc_tools.protoc -I proto --python_out=$$out --grpc_python_out=$$out \
	--plugin=protoc-gen-mypy=$(BIN)/protoc-gen-mypy --plugin=protoc-gen-mypy_grpc=$(BIN)/protoc-gen-mypy_grpc \
	--mypy_out=$$out --mypy_grpc_out=$$out $(PROTOS) >/dev/null && \
	for d in $$(cd proto && find kvshuttle -name '*.proto' -exec dirname {} \; | sort -u); do \
	  touch $$out/$$d/__init__.py; done

proto: venv
	out=$(GEN_OUT); $(GEN)

# Fails when the checked-in generated code differs from what `make proto` would write.
proto-check: venv
	@out=$$(mktemp -d); $(GEN) && \
	for f in $$(cd $$out && find kvshuttle -type f | sort); do \
	  cmp -s "$$out/$$f" "$(GEN_OUT)/$$f" || { echo "stale generated code: $(GEN_OUT)/$$f (run make proto)"; exit 1; }; \
	done && \
	for f in $$(cd $(GEN_OUT) && find kvshuttle -path '*/v1/*' -type f \( -name '*_pb2*' -o -name '__init__.py' \) | sort); do \
	  [ -f "$$out/$$f" ] || { echo "generated file without a proto: $(GEN_OUT)/$$f"; exit 1; }; \
	done && rm -rf $$out && echo "generated code is fresh"

lint: venv
	$(BUF) lint
	$(BUF) format --diff --exit-code
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

typecheck: venv
	$(BIN)/mypy

unit: venv
	$(BIN)/pytest -q

# The Kubernetes manifests (deploy/kubernetes): each overlay rendered offline by kubectl's
# kustomize, every object validated strictly against Kubernetes 1.32's schema (the Gateway API
# objects against their vendored CRDs', deploy/kubernetes/schemas), then the tests
# of what the rendered objects must hold, and the production overlay's gateway -> router mTLS
# with certificates as its Certificates issue them (both also part of `unit`).
deploy-check: venv
	$(BIN)/python -m deploy.kubernetes.check
	$(BIN)/pytest -q tests/deploy/test_kubernetes_manifests.py tests/deploy/test_inference_pool.py \
	  tests/deploy/test_router_certificate.py tests/deploy/test_engine_tracing_manifests.py

# The docs site (mkdocs.yml, docs/): built strictly, so a broken link, a bad anchor or a page missing
# from the tree fails; the API, configuration and error-reason pages are generated from the protos
# and the settings classes at every build (docs/hooks), offline.
docs: venv
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

test: lint proto-check typecheck deploy-check docs vllm unit

# The inner loop: no real vLLM, no chaos, no failover scenario (markers in pyproject.toml), on
# every core (pytest-xdist; each worker collects the suite once, a module's tests stay together).
QUICK_MARKERS := not vllm and not chaos and not slow
quick: lint proto-check typecheck docs
	$(BIN)/pytest -q -n auto --dist loadfile -m "$(QUICK_MARKERS)"

# REGISTRY_STORE=memory|redis (default: memory, or $$KVSHUTTLE_DEMO_REGISTRY_STORE): where the registry keeps its state.
# OTLP_ENDPOINT=http://host:4317 (or $$KVSHUTTLE_OTLP_ENDPOINT): services and engines export their spans there.
demo: venv vllm
	$(BIN)/python -m deploy.demo $(if $(REGISTRY_STORE),--registry-store $(REGISTRY_STORE)) \
	  $(if $(OTLP_ENDPOINT),--otlp-endpoint $(OTLP_ENDPOINT))

# What the demo starts, kept up for your own client until Ctrl-C (deploy/up.py): MODEL=DIR serves a
# local Hugging Face model directory (TOOL_CALL_PARSER=hermes etc. for its tool calls),
# STORE=memory|redis, GATEWAY_PORT (default 8080). The module reads them from the environment.
# OTLP_ENDPOINT=http://host:4317 (or $$KVSHUTTLE_OTLP_ENDPOINT): one trace per turn, as for make demo.
up: venv vllm
	MODEL=$(MODEL) STORE=$(STORE) GATEWAY_PORT=$(GATEWAY_PORT) TOOL_CALL_PARSER=$(TOOL_CALL_PARSER) \
	  $(BIN)/python -m deploy.up $(if $(OTLP_ENDPOINT),--otlp-endpoint $(OTLP_ENDPOINT))

# The registry alone, driven by the kvshuttle CLI (no vLLM): leases, claims, fencing, expiry.
demo-registry: venv
	$(BIN)/python deploy/registry_demo.py

bench: venv
	$(BIN)/python -m bench.registry_bench
	$(BIN)/python -m bench.registry_memory
	$(BIN)/python -m bench.router_bench
	$(BIN)/python -m bench.gateway_added_latency
	$(BIN)/python -m bench.nixl_read

# Gateway -> router -> registry (memory, Redis with 1 and 2 replicas) over stand-in engines, at
# increasing rates; needs redis-server. A few minutes; LOAD_ARGS=--full for 10k turns each.
load: venv
	$(BIN)/python -m bench.load $(LOAD_ARGS)

# The routing policies side by side (issue 20) on emulated engines (bench/emulator), same trace
# and rates; table and bench/results/cluster-*.json. CLUSTER_ARGS=--quick for the small one.
bench-cluster: venv
	$(BIN)/python -m bench.cluster $(CLUSTER_ARGS)

# The fleet simulator (issue 29, bench/fleet): every policy (kvshuttle's real router and registry,
# llm-d and Dynamo as they ship, the baselines) on Mooncake, Claude Code sessions and the agent loop
# at 8P+8D, a rate sweep and three seeds, in virtual time; bench/results/fleet-*.json.
# FLEET_ARGS=--quick for the small one.
bench-fleet: venv
	$(BIN)/python -m bench.fleet $(FLEET_ARGS)

# The flake hunt (tests/flake_hunt.py): the suite and the tests that wait on the world, run again
# and again on a loaded machine; every failure with its log, the tally in .run/flake-hunt/.
flake-hunt: venv vllm
	KVSHUTTLE_REQUIRE_VLLM=1 KVSHUTTLE_REQUIRE_REDIS=1 $(BIN)/python -m tests.flake_hunt $(HUNT_ARGS)

# Every scenario, then its table; the JSON report is kept with the benchmarks' results.
CHAOS_MARKERS ?= chaos
chaos: venv vllm
	KVSHUTTLE_RESULTS_DIR=bench/results $(BIN)/pytest -q -m "$(CHAOS_MARKERS)" tests/chaos

# An engine profile (deploy/profiles/README.md) from NVIDIA's aiconfigurator, in a venv of its own:
# it brings pandas, pyarrow, plotly, bokeh... that the project's venv does without.
PROFILE_VENV := .venv-profile
AICONFIGURATOR_SPEC := aiconfigurator==0.12.0

$(PROFILE_VENV)/.installed:
	$(PY) -m venv $(PROFILE_VENV)
	$(PROFILE_VENV)/bin/pip install -q --upgrade pip
	$(PROFILE_VENV)/bin/pip install -q $(AICONFIGURATOR_SPEC)
	touch $@

profile: $(PROFILE_VENV)/.installed
	@test -n "$(MODEL)" -a -n "$(GPU)" -a -n "$(TP)" || { echo "usage: make profile MODEL=Qwen/Qwen3-32B GPU=h200_sxm TP=2 [OUT=file]"; exit 2; }
	PYTHONPATH=services:. $(PROFILE_VENV)/bin/python -m deploy.profiles.generate \
	  --model $(MODEL) --gpu $(GPU) --tp $(TP) $(if $(OUT),--out $(OUT))

clean:
	rm -rf $(VENV) $(PROFILE_VENV) .pytest_cache .mypy_cache .ruff_cache
