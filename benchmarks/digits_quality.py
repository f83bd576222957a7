"""Digits drawn by the bundled model under each strategy, read by an independent classifier.

    python benchmarks/digits_quality.py [--per-digit 10] [--warmup 1]

For the exact strategies (ulysses 2, ring 2, cfg 2, dp 2) and for PipeFusion with 1 warmup step
(pipefusion 2 and 4, num_patches 2, 4, 8), prints the deviation of the final latents from the
serial run (relative L2, same seeds) and the share of images the classifier reads as the
prompted digit, serial first. The tests' bound on PipeFusion's deviation comes from these
figures (tests/test_pipefusion.py).
"""

import argparse
import itertools

from xdit_lab import ParallelConfig
from xdit_lab.digits.sample import generate_parallel
from xdit_lab.testing import run_on_ranks


def measure(config: ParallelConfig, per_digit: int, serial=None) -> dict:
    out = run_on_ranks(generate_parallel, config.world_size, config, per_digit, timeout_s=1800)[0]
    accuracy = sum(r == d for r, d in zip(out["read"], out["digits"])) / len(out["digits"])
    deviation = None
    if serial is not None:
        deviation = ((out["latents"] - serial["latents"]).norm() / serial["latents"].norm()).item()
    return dict(out, accuracy=accuracy, deviation=deviation)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-digit", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--patches", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args()

    serial = measure(ParallelConfig(), args.per_digit)
    print(f"{'configuration':<32} {'rel. L2 vs serial':>18} {'accuracy':>9} {'seconds':>8}")
    print(f"{'serial':<32} {0.0:>18.4f} {serial['accuracy']:>9.0%} {serial['seconds']:>8.1f}")
    for config in (ParallelConfig(ulysses=2), ParallelConfig(ring=2), ParallelConfig(cfg=2), ParallelConfig(dp=2)):
        row = measure(config, args.per_digit, serial)
        print(f"{config.short():<32} {row['deviation']:>18.2e} {row['accuracy']:>9.0%} {row['seconds']:>8.1f}")
    for stages, patches in itertools.product(args.stages, args.patches):
        config = ParallelConfig(pipefusion=stages, num_patches=patches, warmup_steps=args.warmup)
        name = f"pipefusion {stages}, {patches} patches"
        if patches < stages:
            print(f"{name:<32} {'(fewer patches than stages: not a valid configuration)':>37}")
            continue
        row = measure(config, args.per_digit, serial)
        print(f"{name:<32} {row['deviation']:>18.4f} {row['accuracy']:>9.0%} {row['seconds']:>8.1f}")


if __name__ == "__main__":
    main()
