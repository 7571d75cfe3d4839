#!/usr/bin/env python
"""Publish an evaluation's results (results.json, results.md, plots) with a model card to the Hub.

    python scripts/publish_to_hub.py --results-dir outputs/demo --repo-id user/gsc-fmnist-resnet [--private] [--revision BRANCH]

The same as ``hf-gsc publish``. The token comes from HF_TOKEN (or the huggingface_hub login cache) and the
endpoint from HF_ENDPOINT; the token is never printed or written.
"""
import sys

from hf_gsc.cli import publish


if __name__ == "__main__":
    sys.exit(publish(prog="publish_to_hub.py"))
