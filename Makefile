# The expected spellings: make install, make test, make demo.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install test demo
install: $(VENV)/.installed

$(VENV)/.installed: setup.py
	test -x $(PY) || python3 -m venv $(VENV)
	# torch first, from the local CPU wheel, so that no CUDA build is pulled in by a dependency.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $@

test: install
	$(PY) -m pytest -q tests

demo: install
	$(PY) scripts/demo.py
