"""Quantized weights on the digits: what each scheme costs in accuracy, and what it saves in bytes.

    python benchmarks/quantization.py [--per-digit 4] [--ulysses 2]

The bundled digits model draws per_digit images of each digit (seeds 0..per_digit-1) unquantized, then with
its transformer and text encoder quantized as load_pipeline(quantization=...) loads them: int8 and float8
weight-only (torchao), and the controls, deliberately coarser (int4 with a scale per 32 inputs, int4 and int2
with one per output row: lessons.controls.coarser_quantization). Per row: the relative L2 of the final latents
against the unquantized run (same seeds), the share of images the independent classifier reads as the prompted
digit, and the bytes the transformer's weights hold on a rank. No time: what weight-only schemes buy is memory,
and their speed on a CPU says nothing about a GPU's.
tests/test_quantization.py bounds int8's deviation (INT8_BOUND) with the int4 control above it.
"""

import argparse

from xdit_lab import ParallelConfig
from xdit_lab.testing import run_on_ranks


def _generate(config, per_digit, scheme):
    from xdit_lab.digits.sample import generate_parallel
    from xdit_lab.lessons.controls import coarser_quantization

    controls = {
        "control: int4, scale per 32": lambda: coarser_quantization(4, 32),
        "control: int4, scale per row": lambda: coarser_quantization(4, None),
        "control: int2, scale per row": lambda: coarser_quantization(2, None),
    }
    quantization = controls[scheme]() if scheme in controls else scheme
    return generate_parallel(config, per_digit, quantization=quantization)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-digit", type=int, default=4)
    parser.add_argument("--ulysses", type=int, default=1, help="run every row under Ulysses of this degree")
    args = parser.parse_args()
    config = ParallelConfig(ulysses=args.ulysses)
    schemes = [None, "int8", "float8", "control: int4, scale per 32", "control: int4, scale per row"]
    schemes.append("control: int2, scale per row")
    print(f"digits, {args.per_digit} per digit, {config.short()}; CPU (gloo ranks sharing the cores)")
    print(f"{'weights':<30} {'rel. L2 vs float32':>18} {'accuracy':>9} {'transformer MB':>15}")
    base = None
    for scheme in schemes:
        out = run_on_ranks(_generate, config.world_size, config, args.per_digit, scheme, timeout_s=3600)[0]
        accuracy = sum(r == d for r, d in zip(out["read"], out["digits"])) / len(out["digits"])
        if base is None:
            base = out
        deviation = ((out["latents"] - base["latents"]).norm() / base["latents"].norm()).item()
        print(
            f"{scheme or 'float32 (unquantized)':<30} {deviation:>18.4f} {accuracy:>9.0%} "
            f"{out['transformer_bytes'] / 1e6:>15.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
