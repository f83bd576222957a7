"""Digits drawn by the bundled model under each strategy, read by an independent classifier.

    python benchmarks/digits_quality.py [--per-digit 10] [--warmup 1]

For the exact strategies (ulysses 2, ring 2, cfg 2, dp 2) and for PipeFusion with 1 warmup step
(pipefusion 2 and 4, num_patches 2, 4, 8), prints the deviation of the final latents from the
serial run (relative L2, same seeds) and the share of images the classifier reads as the
prompted digit, serial first. Each PipeFusion row is followed by its controls: the same run with
deliberately wrong K/V buffers (xdit_lab.lessons.controls.wrong_stale_kv: zeros where the stale K/V
belong; each patch reading its own K/V from the step before). The tests' bound on PipeFusion's
deviation (tests/test_pipefusion.py, STALE_BOUND) sits between the real rows and the controls.
"""

import argparse
import itertools

from xdit_lab import ParallelConfig
from xdit_lab.lessons.controls import CONTROLS, generate_with_control
from xdit_lab.testing import run_on_ranks


def measure(config: ParallelConfig, per_digit: int, serial=None, control: str | None = None) -> dict:
    out = run_on_ranks(generate_with_control, config.world_size, config, per_digit, control, timeout_s=1800)[0]
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
    parser.add_argument("--no-controls", action="store_true", help="skip the wrong-buffer control rows")
    parser.add_argument("--no-exact", action="store_true", help="skip the exact strategies' rows")
    args = parser.parse_args()

    serial = measure(ParallelConfig(), args.per_digit)
    print(f"{'configuration':<32} {'rel. L2 vs serial':>18} {'accuracy':>9} {'seconds':>8}")
    print(f"{'serial':<32} {0.0:>18.4f} {serial['accuracy']:>9.0%} {serial['seconds']:>8.1f}")
    exact = (ParallelConfig(ulysses=2), ParallelConfig(ring=2), ParallelConfig(cfg=2), ParallelConfig(dp=2))
    for config in () if args.no_exact else exact:
        row = measure(config, args.per_digit, serial)
        print(f"{config.short():<32} {row['deviation']:>18.2e} {row['accuracy']:>9.0%} {row['seconds']:>8.1f}")
    for stages, patches in itertools.product(args.stages, args.patches):
        config = ParallelConfig(pipefusion=stages, num_patches=patches, warmup_steps=args.warmup)
        name = f"pipefusion {stages}, {patches} patches"
        if patches < stages:
            print(f"{name:<32} {'(fewer patches than stages: not a valid configuration)':>37}")
            continue
        for control in (None, *(() if args.no_controls else CONTROLS)):
            row = measure(config, args.per_digit, serial, control)
            label = name if control is None else f"  control: {control}"
            print(f"{label:<32} {row['deviation']:>18.4f} {row['accuracy']:>9.0%} {row['seconds']:>8.1f}", flush=True)


if __name__ == "__main__":
    main()
