# The two commands of README.md. Each creates .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo plan test setup bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch is pinned here (a CPU wheel lies on the machine's disk); the library itself asks only torch>=2.4
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e ".[test,demo,transformers]"
	touch $@

setup: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/opake demo

# Both cores (pytest-xdist); each test file runs whole in one worker, so its module-scoped set-ups
# run once; tests/conftest.py hands out the files holding slow tests first.
test: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

plan: $(VENV)/.installed
	$(VENV)/bin/opake plan

bench: $(VENV)/.installed
	$(PY) benchmarks/blt_resolve.py
	$(PY) benchmarks/noise_engine.py --sizes 1000000
	$(PY) benchmarks/accounting.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info
