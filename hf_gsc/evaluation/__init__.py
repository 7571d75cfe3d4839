"""Evaluation utilities for OOD detection: metrics (FPR@95%TPR, AUROC, AUPR-In/Out) and the `evaluate` metric module."""
