# Two entry points: `make demo` and `make test`. Both create .venv if missing and install everything into it,
# torch==2.13.0 (CPU build) first so that nothing pulls a multi-GB CUDA build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.memopt-installed

.PHONY: demo test lint bench install clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m memopt_nb demo
	$(PY) -m memopt_nb demo --whole-step

lint: $(STAMP)
	$(PY) -m ruff check .

test: $(STAMP) lint
	$(PY) -m pytest -q --durations=20 tests

bench: $(STAMP)
	$(PY) -m memopt_nb bench

clean:
	rm -rf $(VENV) results test-artifacts
