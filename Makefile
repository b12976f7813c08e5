# dasc-serve: `make test` and `make serve` set everything up on a fresh machine.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install lint test test-fast gpu-check serve loadtest reliability eval clean

HOST ?= http://127.0.0.1:8000
LOADTEST_TIME ?= 60s
LOADTEST_USERS ?= 6

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install --quiet -e '.[test]'
	@touch $(STAMP)

install: $(STAMP)

# ruff: pyflakes, pycodestyle (line length 120), import order, bugbear; settings in pyproject.toml.
lint: $(STAMP)
	$(BIN)/ruff check .

test: lint
	$(BIN)/python -m pytest tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest tests -m "not slow"

# On a CUDA machine: the checks a GPU adds (engine on CUDA vs CPU, TP over NCCL, Triton kernels compiled).
gpu-check: $(STAMP)
	PYTHON=$(BIN)/python bash loadtest/gpu_check.sh

# Install if needed, then serve the shipped default model (configs/config.yaml) on 127.0.0.1:8000.
serve: $(STAMP)
	RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S=60 $(BIN)/serve run configs/config.yaml

# Against a running server: all four locust workloads, headless, bounded in time; CSVs in loadtest/results.
loadtest: $(STAMP)
	mkdir -p loadtest/results
	$(BIN)/locust -f loadtest/locustfile.py --headless -u $(LOADTEST_USERS) -r 2 --run-time $(LOADTEST_TIME) \
		--host $(HOST) --csv loadtest/results/make_loadtest_cpu --only-summary

# The reliability suite of issue 20 (docs/reliability.md): starts its own Ray apps on loopback, runs every scenario
# (bounded: at most 30 minutes on 2 cores) and replaces each scenario's block in docs/reliability.md.
# RELIABILITY_ARGS="--only fuzz,catalogue" or "--short" for a part or a quick pass.
RELIABILITY_ARGS ?=
$(VENV)/.reliability: $(STAMP)
	$(BIN)/pip install --quiet -e '.[test,reliability]'
	@touch $@

reliability: $(VENV)/.reliability
	RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S=60 $(BIN)/python -m loadtest.reliability --out docs/reliability.md \
		$(RELIABILITY_ARGS)

# lm-evaluation-harness against our API (docs/fidelity.md): reference agreement with lm-eval's hf model, then answer
# and logprob fidelity of every dasc setting against dense, each on local servers it starts on loopback (about an
# hour on 2 cores; EVAL_ARGS="--limit 10 --settings dense,nr-W16" for a quick pass, "--url $(HOST)" to score the
# reference run through a running `make serve`). Tasks are files in loadtest/eval/tasks: nothing is downloaded.
EVAL_ARGS ?=
$(VENV)/.eval: $(STAMP)
	$(BIN)/pip install --quiet -e '.[test,eval]'
	@touch $@

eval: $(VENV)/.eval
	HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 $(BIN)/python -m loadtest.eval.run --out docs/fidelity.md $(EVAL_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
