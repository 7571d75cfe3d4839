"""Gradient Short-Circuit's machinery below the detector: the short-circuit masks and operations (pure
tensor math), the GSC step after the backbone, and the backends that linearise the head at ``F``
(closed form, autograd, several layers, shaped features). GSC's detector is
:mod:`hf_gsc.detectors.gsc`; this floor knows no detector.
"""
