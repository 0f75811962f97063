# The README's two commands: `make demo` and `make test`. Both set up .venv when needed.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch; set TORCH= to another requirement (or keep an installed torch).
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.psar-installed
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
PYTEST_ARGS ?=
# make test's pytest workers (pytest-xdist): the tests wait on their processes' timers and
# sockets as much as they compute, so two on 2 cores take 7:10 where one took 8:39. The pooled
# runs (tests/conftest.py) stay on one worker. PYTEST_WORKERS=0: one process, as before.
PYTEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadgroup -p no:benchmark)
# Where Python writes no bytecode of its own (PYTHONDONTWRITEBYTECODE, as on this project's
# CI machines), every process would compile psar's modules again: 196 ms of a worker's import,
# 33 ms read compiled. Compiled before each command (only what changed), stale files ignored.
COMPILE := $(PY) -m compileall -q ps allreduce experiments analysis

.PHONY: install demo test bench stress docs clean

install: $(STAMP)

# --system-site-packages: a torch already importable here (a CUDA build, say) is kept.
$(STAMP): setup.cfg setup.py pyproject.toml $(wildcard ps/_*.c ps/_*.h ps/shard/_*.c ps/shard/_*.h)
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) "$(TORCH)"
	$(PIP) -e ".[test]"
	touch $@

demo: $(STAMP)
	$(COMPILE)
	$(VENV)/bin/psar compare quickstart --engines local,ddp,allreduce,ps-sync,ps-async,ps-ssp --repeats 3 --out runs/demo --overwrite

test: $(STAMP)
	$(COMPILE)
	$(PY) -m pytest $(XDIST) $(PYTEST_ARGS)

bench: $(STAMP)
	$(COMPILE)
	$(VENV)/bin/psar bench
	$(PY) -m pytest -m long -s -p no:cacheprovider
	@if [ "$$(id -u)" = 0 ]; then $(VENV)/bin/psar compare predict --out runs/bench-predict --overwrite; \
	else echo "psar compare predict (psar predict on held-out runs) needs root for its emulated links: skipped"; fi

# Timing bugs: the multi-process tests ROUNDS times (LOAD=1 keeps every core busy meanwhile).
ROUNDS ?= 10
LOAD ?=
stress: $(STAMP)
	$(COMPILE)
	$(PY) tests/stress.py --rounds $(ROUNDS) $(if $(LOAD),--load) $(STRESS_FILES)

# docs/settings.md from the config dataclasses' field docstrings (tests/unit/test_docs.py checks it).
docs: $(STAMP)
	$(PY) -m experiments.settings.reference > docs/settings.md

clean:
	rm -rf $(VENV) runs .pytest_cache
