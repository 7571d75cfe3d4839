"""hf_gsc's version: a module of its own, so that modules which record it (a saved detector's config, an
evaluation's fingerprints) import it without importing the package's top level, which imports everything."""

__version__ = "0.4.0"
