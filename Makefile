# The expected spellings: make install, make test, make demo; make lint runs the linter and the type checker, make
# docs builds the documentation site.
VENV ?= .venv
PY := $(VENV)/bin/python
# Debian packages that hold the offline benchmark data (Fashion-MNIST, real digits, photos, fonts).
DATA_PACKAGES := dataset-fashion-mnist opencv-doc fonts-dejavu-core fonts-liberation fonts-freefont-ttf

.PHONY: install install-data test test-space lint demo docs
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

# Everything but the Space test, which installs a Space's requirements from the package index (make test-space).
test: install
	$(PY) -m pytest -q -m 'not space' tests

# tests/test_space.py's install: a Space folder's requirements.txt into a fresh environment, then its app.py, asked
# by gradio_client (measured on 2 cores: 264 s with pip's cache cold, 76 s warm; most of it pip installing Gradio and
# transformers).
test-space: install
	$(PY) -m pytest -q -m space tests

# ruff and mypy (the test extra) with the settings in pyproject.toml.
lint: install
	$(PY) -m ruff check hf_gsc
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
