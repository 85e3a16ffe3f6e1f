# kvcentric — build, test and run everything from the repository root.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c

MODULES := proto pkg controlplane sidecar-prefill sidecar-decode gateway sim
BIN := $(CURDIR)/bin
GO ?= go
# The repository needs Go 1.27 (go.work, every go.mod): the go command fetches this toolchain from
# the module proxy once per machine. A machine starts on its own Go, so every recipe runs with it.
GOTOOLCHAIN_VERSION := go1.27.3
export GOTOOLCHAIN := $(GOTOOLCHAIN_VERSION)

# binary -> module/cmd path
BINARIES := \
	controlplane/cmd/kvc-controlplane \
	sidecar-prefill/cmd/kvc-sidecar-prefill \
	sidecar-decode/cmd/kvc-sidecar-decode \
	gateway/cmd/kvc-gateway \
	sim/cmd/kvc-sim \
	sim/cmd/kvc-local \
	sim/cmd/kvc-bench

PROTOC_GEN_GO_VERSION := v1.36.11
PROTOC_GEN_GO_GRPC_VERSION := v1.6.0
BUF_VERSION := v1.75.0
GRPCURL_VERSION := v1.9.3
# golangci-lint builds with this repository's Go ($(GOTOOLCHAIN_VERSION)): the binary's name carries both
# versions, so one built by another toolchain is never reused. Bump deliberately and fix what it finds.
GOLANGCI_LINT_VERSION := v2.15.0
GOLANGCI_LINT := $(BIN)/tools/golangci-lint-$(GOLANGCI_LINT_VERSION)-$(GOTOOLCHAIN_VERSION)
# ruff lints every Python file under integrations/ (integrations/ruff.toml) at the version
# integrations/requirements-lint.txt pins, from a venv of its own in bin/tools/: make lint runs
# before the SGLang test venv exists. Its cache goes to bin/tools/ too.
RUFF_VERSION := $(shell sed -n 's/^ruff==//p' integrations/requirements-lint.txt)
RUFF_VENV := $(BIN)/tools/ruff-$(RUFF_VERSION)
RUFF := $(RUFF_VENV)/bin/ruff
# The wire-drift test's own small venv (grpcio, protobuf, pytest: integrations/requirements-wire.txt),
# so `make test` checks wire.py against the proto image without SGLang's venv.
WIRE_VENV := $(BIN)/tools/wire-$(shell sha256sum integrations/requirements-wire.txt | cut -c1-12)
# promtool (Prometheus v3's, module version v0.316.0) checks and unit-tests deploy/prometheus's
# alert rules; built with this repository's Go, its name carries both versions like golangci-lint's.
PROMTOOL_VERSION := v0.316.0
PROMTOOL := $(BIN)/tools/promtool-$(PROMTOOL_VERSION)-$(GOTOOLCHAIN_VERSION)
# The API as last released: buf breaking compares proto/ with it (make proto-image updates it).
API_IMAGE := proto/api.binpb


.PHONY: grpcurl
.PHONY: test-faults
.PHONY: test-sglang test-wire
.PHONY: lint-nevers check-modules check-deps proto-lint proto-breaking proto-image
.PHONY: bench-real
.PHONY: all build test test-short lint fmt proto proto-check tools demo bench-sweep bench-sweep-parallel bench bench-transfer bench-policy bench-gateway bench-gpu test-mooncake tidy clean

all: build

## build: every binary into bin/ (static, CGO_ENABLED=0)
build:
	@mkdir -p $(BIN)
	@for b in $(BINARIES); do \
		mod=$${b%%/cmd/*}; name=$${b##*/}; \
		if [ -d "$$b" ]; then \
			echo "build $$name"; \
			(cd $$mod && CGO_ENABLED=0 $(GO) build -trimpath -o $(BIN)/$$name ./cmd/$$name); \
		fi; \
	done

## test: every module with the race detector (integration tests use bin/), each on its own
## go.mod (GOWORK=off: a module that only builds inside the workspace fails here)
test: build
	@for m in $(MODULES); do \
		echo "== test $$m"; \
		(cd $$m && GOWORK=off CGO_ENABLED=1 KVC_BIN_DIR=$(BIN) $(GO) test -race -count=1 -timeout 600s ./...); \
	done
	@$(MAKE) --no-print-directory test-wire

## test-wire: the SGLang plugin's hand-written protobuf codec (wire.py) against proto/api.binpb
## (field numbers and wire types of every message it writes or reads), in a small venv of its own
test-wire: $(WIRE_VENV)/bin/pytest
	@echo "== test wire.py against proto/api.binpb"
	@cd integrations/sglang && $(WIRE_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_wire_drift.py

$(WIRE_VENV)/bin/pytest: integrations/requirements-wire.txt
	@rm -rf $(WIRE_VENV)
	python3 -m venv $(WIRE_VENV)
	$(WIRE_VENV)/bin/pip install -q -r integrations/requirements-wire.txt

## test-sglang: the SGLang plugin's pytest suite against SGLang 0.5.23's real classes (CPU, no GPU
## kernels; venv made once by integrations/sglang/scripts/make-venv.sh, pip cache reused) and the
## real sidecar binaries (built into bin/); then kvc-refworker's suite (a real model's attention KV
## through kvc-local, the control-plane pair, the gateway and the real sidecars; 0 recompute mismatches)
test-sglang: build
	@venv="$$(integrations/sglang/scripts/make-venv.sh)"; \
	"$$venv/bin/pip" install -q --no-deps --no-build-isolation -e integrations/sglang >/dev/null 2>&1 || \
		"$$venv/bin/pip" install --no-deps --no-build-isolation -e integrations/sglang; \
	(cd integrations/sglang && KVC_BIN_DIR=$(BIN) timeout 600 "$$venv/bin/python" -m pytest -q -p no:warnings -p no:cacheprovider tests); \
	echo "== kvc-refworker (real attention KV through kvc-local, every mode, recompute check)"; \
	KVC_BIN_DIR=$(BIN) timeout 600 "$$venv/bin/python" -m pytest -q -p no:warnings -p no:cacheprovider integrations/refworker/tests

## test-faults: every fault under session load on a real cluster (docs/reliability.md);
## FAULTS=ci (default, the CI subset), FAULTS=all, or FAULTS=name,name; log in out/faults/
test-faults: build
	@mkdir -p out/faults
	@rc=0; (cd sim && KVC_BIN_DIR=$(BIN) KVC_FAULTS=$${FAULTS:-ci} KVC_FAULTS_OUT=$(CURDIR)/out/faults \
		$(GO) test -count=1 -timeout 1500s -run '^TestFaults$$' -v ./internal/faults/) > out/faults/test.log 2>&1 || rc=$$?; \
	if [ $$rc -ne 0 ]; then grep -vE '^(fault|faults):' out/faults/test.log | tail -60; fi; \
	grep -E '^(baseline|fault|faults):' out/faults/test.log || true; \
	exit $$rc

## test-short: unit tests only
test-short:
	@for m in $(MODULES); do (cd $$m && $(GO) test -short -count=1 ./...); done

## lint: gofmt, promtool on the alert rules (check, then the rules' unit tests: each alert fires),
## then golangci-lint (.golangci.yml: govet, staticcheck, errcheck, depguard's nevers, ...) on every
## module on its own go.mod, then lint-nevers, then ruff check and ruff format --check on integrations/
## (integrations/ruff.toml; `ruff format integrations` fixes the second)
lint: $(GOLANGCI_LINT) $(PROMTOOL) $(RUFF)
	@out=$$(gofmt -l $$(git ls-files '*.go' | grep -v '\.pb\.go$$')); \
	if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	@echo "== promtool deploy/prometheus"
	@$(PROMTOOL) check rules deploy/prometheus/kvc-alerts.yml
	@cd deploy/prometheus && $(PROMTOOL) test rules kvc-alerts.test.yml
	@for m in $(MODULES); do \
		echo "== lint $$m"; \
		(cd $$m && GOWORK=off $(GOLANGCI_LINT) run --allow-serial-runners --config $(CURDIR)/.golangci.yml ./...); \
	done
	@$(MAKE) --no-print-directory lint-nevers
	@echo "== ruff integrations"
	@$(RUFF) check --cache-dir $(BIN)/tools/ruff-cache integrations
	@$(RUFF) format --check --cache-dir $(BIN)/tools/ruff-cache integrations

## lint-nevers: the depguard rules fail on imports that break the architecture's nevers
## (docs/architecture.md): a temporary copy of the tree with one planted import per rule must fail
## golangci-lint under that rule, and a test file importing a test helper must pass (.ci/lint-nevers)
lint-nevers: $(GOLANGCI_LINT)
	@echo "== lint-nevers"
	@.ci/lint-nevers $(GOLANGCI_LINT)

## check-modules: every module stands alone — GOWORK=off go build and go vet, and go mod tidy
## leaves go.mod and go.sum as committed; then check-deps
check-modules: check-deps
	@for m in $(MODULES); do \
		echo "== module $$m"; \
		(cd $$m && GOWORK=off $(GO) build ./... && GOWORK=off $(GO) vet ./... && \
			GOWORK=off $(GO) mod tidy -diff) || { echo "module $$m: not standalone or not tidy (run: make tidy)"; exit 1; }; \
	done

## check-deps: no binary links the testing package (test helpers stay out of production code)
check-deps:
	@for b in $(BINARIES); do \
		mod=$${b%%/cmd/*}; \
		bad=$$(cd $$mod && GOWORK=off $(GO) list -deps ./cmd/$${b##*/} | grep -E '^testing(/|$$)|/etcdtest$$|/hatest$$' || true); \
		if [ -n "$$bad" ]; then echo "$${b##*/} links test code: $$bad"; exit 1; fi; \
	done; echo "check-deps: no binary links testing"

fmt:
	@gofmt -w $$(git ls-files '*.go' | grep -v '\.pb\.go$$')

## tools: pinned code generators, buf, golangci-lint and promtool into bin/
tools: $(BIN)/protoc-gen-go $(BIN)/protoc-gen-go-grpc $(BIN)/buf $(GOLANGCI_LINT) $(PROMTOOL)

$(BIN)/protoc-gen-go:
	GOBIN=$(BIN) $(GO) install google.golang.org/protobuf/cmd/protoc-gen-go@$(PROTOC_GEN_GO_VERSION)
$(BIN)/protoc-gen-go-grpc:
	GOBIN=$(BIN) $(GO) install google.golang.org/grpc/cmd/protoc-gen-go-grpc@$(PROTOC_GEN_GO_GRPC_VERSION)
$(BIN)/buf:
	GOBIN=$(BIN) $(GO) install github.com/bufbuild/buf/cmd/buf@$(BUF_VERSION)
$(GOLANGCI_LINT):
	@mkdir -p $(BIN)/tools/tmp
	GOBIN=$(BIN)/tools/tmp $(GO) install github.com/golangci/golangci-lint/v2/cmd/golangci-lint@$(GOLANGCI_LINT_VERSION)
	mv $(BIN)/tools/tmp/golangci-lint $@
$(RUFF):
	@rm -rf $(RUFF_VENV)
	python3 -m venv $(RUFF_VENV)
	$(RUFF_VENV)/bin/pip install -q -r integrations/requirements-lint.txt
$(PROMTOOL):
	@mkdir -p $(BIN)/tools/tmp-promtool
	GOBIN=$(BIN)/tools/tmp-promtool $(GO) install github.com/prometheus/prometheus/cmd/promtool@$(PROMTOOL_VERSION)
	mv $(BIN)/tools/tmp-promtool/promtool $@
$(BIN)/grpcurl:
	GOBIN=$(BIN) $(GO) install github.com/fullstorydev/grpcurl/cmd/grpcurl@$(GRPCURL_VERSION)

## grpcurl: the pinned grpcurl into bin/ (for the operations and routing docs' examples)
grpcurl: $(BIN)/grpcurl

## proto: lint and regenerate proto/kvc/v1 (generated code is committed)
proto: $(BIN)/protoc-gen-go $(BIN)/protoc-gen-go-grpc $(BIN)/buf
	$(BIN)/buf lint
	PATH=$(BIN):$$PATH $(BIN)/buf generate

## proto-lint: buf lint on proto/ (buf.yaml: STANDARD)
proto-lint: $(BIN)/buf
	$(BIN)/buf lint

## proto-breaking: buf lint, then buf breaking (FILE rules) against the committed API image
## $(API_IMAGE); an intended break is made by updating the image (make proto-image) in the same
## commit, with the reason in the message
proto-breaking: proto-lint
	$(BIN)/buf breaking --against $(API_IMAGE)

## proto-image: rebuild the committed API image from proto/ (deliberately: after a release, or
## with an intended breaking change)
proto-image: proto-lint
	$(BIN)/buf build --exclude-source-info -o $(API_IMAGE)

## proto-check: fail when the committed generated code is stale
proto-check: proto
	git diff --exit-code -- proto/

## demo: the main job — two local cluster shapes, 1P3D (the seeds' rig, prefill-bound) then 2P4D
## (llm-d's), arms PD/SGL/LLMD (the baselines) and E3/E4 on the built-in workload on each; in every
## arm the engine of the decode worker holding the most sessions crashes mid-run (its sidecar lives
## and reports it down: one GPU's process under systemd), targets stated per shape; out/demo/summary.json ({shape: {arm: ...}})
## and report.md cover both, out/demo/1P3D/ and out/demo/2P4D/ hold each shape's files
## (--send-ids: the client keeps its conversation as token ids, so edited-history turns and page
## hashes reach the control plane)
DEMO_ARMS ?= PD,SGL,LLMD,E3,E4
DEMO_SHAPES ?= 1P3D,2P4D
BENCH_FLAGS = --local --bin-dir $(BIN) --time-scale 0.3 --sim-args "--page-size 64 --layers 8 --prealloc-wait 20s" \
	--decode-capacity-tokens 88000 --send-ids --slo-ttft 2s --slo-tpot 50ms
demo: build
	$(BIN)/kvc-bench $(BENCH_FLAGS) --arms $(DEMO_ARMS) --shapes $(DEMO_SHAPES) --sessions 16 --kill-decode most --kill-worker-only --kill-at 45s --out out/demo

## bench-sweep: the baselines and kvcentric (PD,SGL,LLMD,E3,E4) on both shapes (× 8 sessions: 1P3D at
## 6 loads, 4-40 sessions; 2P4D at 7, 8-96: past where the best baseline saturates), plus one 2P4D
## point with H200-sized decode pools (700K tokens); out/sweep/sweep.json (points, slo_capacity),
## sweep.md and per-shape plots (one point after another: about two hours on 2 cores)
SWEEP_ARMS ?= PD,SGL,LLMD,E3,E4
SWEEP ?= 1P3D=0.5,1,2,3,4,5;2P4D=1,2,4,6,8,10,12;2P4D@700K=2
bench-sweep: build
	$(BIN)/kvc-bench $(BENCH_FLAGS) --arms $(SWEEP_ARMS) --sessions 8 --sweep "$(SWEEP)" --out out/sweep

## bench-sweep-parallel: the same sweep with each point and arm in its own kvc-bench process, at most
## JOBS at once (default 4: a 16-core machine stays at a load average of about 5 — E4 at the top of
## 1P3D is CPU-contention-sensitive, docs/benchmark.md — about 25 min there), gathered into one
## sweep.json (--sweep-gather); OUT/logs/loadavg.log samples the load average
JOBS ?= 4
bench-sweep-parallel: build
	JOBS=$(JOBS) SPLIT_ARMS=1 deploy/bench/sweep-parallel.sh $(BIN) out/sweep "$(SWEEP)" $(SWEEP_ARMS) 8 $(BENCH_FLAGS)

## bench-gateway: the gateway's tokenize + chat template + page hash cost per 32K-token prompt
## against the direct-to-D TTFT p50 of out/demo's report (run make demo first; else DESIGN.md's)
bench-gateway:
	cd gateway && KVC_BENCH_GATEWAY=1 KVC_DEMO_REPORT=$(CURDIR)/out/demo/report.md $(GO) test -count=1 -run '^TestBenchGateway$$' -v ./internal/server/ | grep '^tokenize'

## bench-transfer: pkg/rdma tcp backend vs a raw socket copy
bench-transfer:
	cd pkg && $(GO) test -run '^$$' -bench BenchmarkTransfer -benchtime 1x ./rdma/... | tee /dev/stderr | grep '^transfer:' | tail -1

## bench-policy: routing decisions in process and over one Route stream
bench-policy:
	cd controlplane && $(GO) test -run '^$$' -bench 'Policy$$' -benchtime 1x ./internal/policybench/... | grep -E '^policy(-detail|-memory)?:'

## bench-gpu: static binaries for the GPU machine (bin/gpu); prints the command to run there
bench-gpu:
	@mkdir -p $(BIN)/gpu
	cd pkg && CGO_ENABLED=0 $(GO) test -c -trimpath -ldflags="-s -w" -o $(BIN)/gpu/rdma.test ./rdma/
	cd sidecar-decode && CGO_ENABLED=0 $(GO) test -c -trimpath -ldflags="-s -w" -o $(BIN)/gpu/gpubench.test ./internal/gpubench/
	cd sidecar-decode && CGO_ENABLED=0 $(GO) build -trimpath -ldflags="-s -w" -o $(BIN)/gpu/kvc-sidecar-decode ./cmd/kvc-sidecar-decode
	cd sidecar-prefill && CGO_ENABLED=0 $(GO) build -trimpath -ldflags="-s -w" -o $(BIN)/gpu/kvc-sidecar-prefill ./cmd/kvc-sidecar-prefill
	@echo "on the GPU machine, from the repository root (carry bin/gpu):  bash deploy/gpu/bench-gpu.sh"
	@echo "it writes out/gpu/gpu-tests.txt, gpu-bench.txt and gpu-sidecars.txt (or \$$OUT/...); see docs/gpu.md"

## bench-real: prepare the real-model GPU run (issue 12): static binaries packed into bin/real.tar.xz;
## on the GPU machine, from the repository root with it carried: bash deploy/gpu/run-real.sh
bench-real:
	bash deploy/gpu/prepare-real.sh

## test-mooncake: bytes through Mooncake's own transport (needs libtransfer_engine.so)
test-mooncake:
	cd pkg && KVC_MOONCAKE_TEST=1 $(GO) test -count=1 -run Mooncake -v ./rdma/...

## tidy: go mod tidy in every module on its own go.mod (what check-modules checks)
tidy:
	@for m in $(MODULES); do (cd $$m && GOWORK=off $(GO) mod tidy); done

clean:
	rm -rf bin out
