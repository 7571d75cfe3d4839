"""A shim over pyproject.toml, where everything about the package is declared: for tools that still call
``python setup.py ...`` (``python setup.py --version``) and for ``pip install .`` on old pips."""

from setuptools import setup

setup()
