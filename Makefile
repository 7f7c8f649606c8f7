# Everything a fresh machine needs: `make demo` runs the main job, `make test` the test suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint system-deps venv bench gpu-check clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

system-deps:
	@command -v promtool >/dev/null && command -v prometheus-pushgateway >/dev/null && \
		command -v victoria-metrics >/dev/null || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus \
			prometheus-pushgateway victoria-metrics)

demo: $(STAMP)
	$(VENV)/bin/torchtelemetry demo --steps 600 --step-delay-s 0.05  # ~45 s: time to open the /metrics URL it prints

lint: $(STAMP)
	$(PY) -m ruff check src tests bench
	$(PY) -m ruff format --check src tests bench
	$(VENV)/bin/lint-imports  # the layers and private modules of .importlinter

test: system-deps $(STAMP) lint
	$(PY) -m pytest -q -p no:cacheprovider -n 4 --dist worksteal  # many tests wait on servers and ranks

# On a machine with a CUDA device, even a bare offline image (python3 with torch+CUDA, pytest, numpy,
# prometheus-client; no venv, no pip): the cuda-marked tests and the GPU figures, one table (README).
# Without a CUDA device it collects the tests (proving they import) and exits 2.
gpu-check:
	PYTHONPATH=src $(PYTHON) -m bench.gpu_check

bench: $(STAMP)  # the comparisons of bench/README.md (bench.soak is a separate, long run)
	$(PY) -m bench.bench_sync
	$(PY) -m bench.bench_collect
	$(PY) -m bench.bench_window
	$(PY) -m bench.bench_demo

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
