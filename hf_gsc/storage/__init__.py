"""The saved format and the Hub: a detector folder described, written, read and bound to
``from_pretrained`` / ``save_pretrained``; the evaluation results it carries; its model card; pushing a
detector and publishing an evaluation's results; telling a Hub repo id from a local path. Knows the
settings and the registry, not the detectors' code.
"""
