# The expected spellings: make install, make test, make demo; make lint runs the linter and the type checker, make
# docs builds the documentation site.
VENV ?= .venv
PY := $(VENV)/bin/python
# Debian packages that hold the offline benchmark data (Fashion-MNIST, real digits, photos, fonts).
DATA_PACKAGES := dataset-fashion-mnist opencv-doc fonts-dejavu-core fonts-liberation fonts-freefont-ttf

# make test-timm: the timm tests in an environment of their own (see the target).
VENV_TIMM ?= .venv-timm
PY_TIMM := $(VENV_TIMM)/bin/python

.PHONY: install install-data test test-memory test-space test-timm lint demo docs
install: install-data $(VENV)/.installed

# Idempotent: installs the Debian data packages only when one is missing (needs root or sudo).
install-data:
	@missing=$$(for p in $(DATA_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
		sudo=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		echo "installing Debian data packages: $$missing"; \
		$$sudo apt-get update -qq && $$sudo apt-get install -y -qq $$missing >/dev/null; \
	fi

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# torch first, from the local CPU wheel, so that no dependency pulls in a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[all,test]'
	touch $@

# Everything but the Space test, which installs a Space's requirements from the package index (make test-space), and
# the per-family peak-memory processes (make test-memory).
test: install
	$(PY) -m pytest -q -m 'not space and not memory' tests

# tests/test_fit_peak_memory.py's per-family measurements: ten fresh processes fitting one method each at two sizes.
test-memory: install
	$(PY) -m pytest -q -m memory tests

# tests/test_space.py's install: a Space folder's requirements.txt into a fresh environment, then its app.py, asked
# by gradio_client (measured on 2 cores: 264 s with pip's cache cold, 76 s warm; most of it pip installing Gradio and
# transformers).
test-space: install
	$(PY) -m pytest -q -m space tests

# The tests that need timm (tests/test_timm_models.py; the timm rows of tests/test_brought_models.py: -k timm), which skip in
# .venv. timm needs torchvision, whose Linux wheels on the package index are CUDA builds pinning the CUDA torch, so
# this environment has that torch and its CUDA libraries (5.5 GB; it runs on the CPU), and .venv keeps the CPU torch
# without torchvision. HF_GSC_REQUIRE_TIMM=1 turns the tests' skip without timm into a failure. Idempotent.
test-timm: install-data $(VENV_TIMM)/.installed
	HF_GSC_REQUIRE_TIMM=1 $(PY_TIMM) -m pytest -q -rs -k timm tests/test_timm_models.py tests/test_brought_models.py

$(VENV_TIMM)/.installed: pyproject.toml
	test -x $(PY_TIMM) || python3 -m venv $(VENV_TIMM)
	# torchvision first, with the torch build it was made for.
	$(PY_TIMM) -m pip install -q torchvision
	$(PY_TIMM) -m pip install -q -e '.[evaluation,timm]' 'pytest>=8'
	touch $@

# ruff and mypy (the test extra) with the settings in pyproject.toml.
lint: install
	$(PY) -m ruff check hf_gsc tests scripts
	$(PY) -m mypy

demo: install
	$(PY) scripts/demo.py

# The documentation site from docs/ and the docstrings, into site/; a warning (a broken link, a docstring the API
# reference cannot parse) fails it.
docs: install $(VENV)/.docs-installed
	$(PY) -m mkdocs build --strict --site-dir site

$(VENV)/.docs-installed: pyproject.toml
	$(PY) -m pip install -q -e '.[docs]'
	touch $@
