"""StepCache on the bundled digits model: steps skipped against quality and time, per strategy.

    python benchmarks/step_cache.py [--per-digit 10] [--thresholds 0 0.05 0.1 ...]

For serial, ulysses 2 and pipefusion 2 (1 warmup step, 2 patches), and each threshold: the steps
the cache skipped (of the model's 20), the share of the 100 digits the independent classifier reads
as prompted, the deviation of the final latents from the same configuration without a cache
(relative L2, same seeds) and the denoising seconds beside the uncached run's, in one run. The
last threshold (1e9, a control) skips every step after the first. All 100
images are one batch, so each step's decision is taken over all of them. Ranks share this machine's
cores: read the seconds as ratios within a configuration, not across them.
"""

import argparse

from xdit_lab import ParallelConfig, StepCache
from xdit_lab.digits.sample import generate_parallel
from xdit_lab.testing import run_on_ranks

CONFIGS = [ParallelConfig(), ParallelConfig(ulysses=2), ParallelConfig(pipefusion=2, num_patches=2, warmup_steps=1)]


def measure(config, per_digit, threshold):
    cache = StepCache(threshold) if threshold else None
    out = run_on_ranks(generate_parallel, config.world_size, config, per_digit, cache, timeout_s=1800)
    skips = [rank["skips"] for rank in out]
    if any(s != skips[0] for s in skips):
        raise AssertionError(f"ranks disagree on the skipped steps: {skips}")
    out = out[0]
    accuracy = sum(r == d for r, d in zip(out["read"], out["digits"])) / len(out["digits"])
    return dict(out, accuracy=accuracy)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-digit", type=int, default=10)
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1e9])
    args = parser.parse_args()
    print("| configuration | threshold | steps skipped | accuracy | rel. L2 vs no cache | denoise s | vs no cache |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for config in CONFIGS:
        name = config.short() if config.world_size > 1 else "serial"
        if config.pipefusion > 1:
            name += " (2 patches, warmup 1)"
        base = measure(config, args.per_digit, 0)
        rows = [(0, base)] + [(t, measure(config, args.per_digit, t)) for t in args.thresholds]
        for threshold, row in rows:
            deviation = ((row["latents"] - base["latents"]).norm() / base["latents"].norm()).item()
            skipped = sum(row["skips"])
            print(
                f"| {name} | {threshold:g} | {skipped} of {len(row['skips'])} | {row['accuracy']:.0%} | "
                f"{deviation:.4f} | {row['denoise_seconds']:.2f} | {row['denoise_seconds'] / base['denoise_seconds']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
