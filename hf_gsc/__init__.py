"""Gradient Short-Circuit OOD detection for Hugging Face image classifiers."""
__version__ = "0.1.0"
