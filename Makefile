# Two entry points: `make demo` and `make test` (every test; `make test-fast` leaves out those marked slow). Both create
# .venv if missing and install everything into it, torch==2.13.0 (CPU build) first so that nothing pulls a multi-GB
# CUDA build. timm and the torchvision matching that torch (no deps: they would pull a CUDA torch) go in a directory of
# their own, $(VENV)/timm-packages, that only the timm tests put on sys.path: the registry's torchvision is built for
# CUDA torch and, installed beside transformers, breaks its models (tests/real_timm.py says why and how it imports).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.memopt-installed

.PHONY: demo test test-fast lint bench install clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps --upgrade --target $(VENV)/timm-packages torchvision==0.28.0 timm==1.0.31
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m memopt_nb demo
	$(PY) -m memopt_nb demo --whole-step

lint: $(STAMP)
	$(PY) -m ruff check .

# two pytest workers (pytest-xdist); an idle worker takes tests from the other's queue (worksteal), so a file of long
# tests (the tutorials) does not hold one worker while the other waits; JOBS=1 runs them in this process
JOBS ?= 2
XDIST = $(if $(filter 1,$(JOBS)),,-n $(JOBS) --dist worksteal)

test: $(STAMP) lint
	$(PY) -m pytest -q --durations=20 $(XDIST) tests

# the inner loop: every test but those marked slow (pytest -m slow runs just those)
test-fast: $(STAMP)
	$(PY) -m pytest -q --durations=10 $(XDIST) -m "not slow" tests

bench: $(STAMP)
	$(PY) -m memopt_nb bench

clean:
	rm -rf $(VENV) results test-artifacts
