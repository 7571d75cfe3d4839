#!/usr/bin/env python
"""Publish an evaluation's results (results.json, results.md, plots) with a model card to the Hub.

    python scripts/publish_to_hub.py --results-dir outputs/demo --repo-id user/gsc-fmnist-resnet [--private] [--revision BRANCH]

The token comes from HF_TOKEN (or the huggingface_hub login cache) and the endpoint from HF_ENDPOINT;
the token is never printed or written.
"""

from __future__ import annotations

import argparse
import sys

from hf_gsc.hub import HubError, publish_results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results-dir", required=True, help="an --output-dir of scripts/evaluate_ood.py")
    parser.add_argument("--repo-id", required=True, help="Hub repo id, e.g. user/gsc-fmnist-resnet")
    parser.add_argument("--private", action="store_true", help="create the repo as private")
    parser.add_argument("--revision", default=None, help="branch to push to (created if missing)")
    args = parser.parse_args(argv)
    try:
        url = publish_results(args.results_dir, args.repo_id, private=args.private, revision=args.revision)
    except (HubError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"published {args.results_dir} to {args.repo_id}: {url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
