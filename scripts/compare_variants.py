#!/usr/bin/env python
"""Beyond the paper (issue #8): adaptive mask size, Fisher selection and multi-layer GSC against
default GSC and Energy, with a validation-only selection protocol. See docs/beyond_the_paper.md.

    python scripts/compare_variants.py --archs resnet,vit,swin --benchmarks fmnist-ood,fmnist-openset \\
        --max-samples 1000 --max-fit-samples 5000 --output-dir runs/variants

Writes ``{output-dir}/{benchmark}/{arch}.json`` (reused by a rerun with the same settings) and
``{output-dir}/variants.md``; logic in ``hf_gsc.analysis.variants``.
"""
import argparse
import sys

from hf_gsc.analysis.variants import ARCHS, BENCHMARK_NAMES, run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="compare_variants.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", default=",".join(ARCHS), help="reference models, comma-separated")
    parser.add_argument("--benchmarks", default=",".join(BENCHMARK_NAMES), help="benchmarks, comma-separated")
    parser.add_argument("--max-samples", type=int, default=1000, help="samples per split (test and validation)")
    parser.add_argument("--max-fit-samples", type=int, default=5000, help="ID train samples for the Fisher fit")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default="runs/variants")
    args = parser.parse_args(argv)
    for name in args.archs.split(","):
        if name not in ARCHS:
            parser.error(f"--archs: unknown {name!r}; expected some of {', '.join(ARCHS)}")
    for name in args.benchmarks.split(","):
        if name not in BENCHMARK_NAMES:
            parser.error(f"--benchmarks: unknown {name!r}; expected some of {', '.join(BENCHMARK_NAMES)}")
    if args.max_samples < 1 or args.max_fit_samples < 2 or args.batch_size < 1:
        parser.error("--max-samples and --batch-size must be >= 1, --max-fit-samples >= 2")
    print(run(args.archs.split(","), args.benchmarks.split(","), args.output_dir, args.max_samples,
              args.max_fit_samples, args.seed, args.batch_size))
    return 0


if __name__ == "__main__":
    sys.exit(main())
