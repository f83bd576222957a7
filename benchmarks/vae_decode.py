"""The VAE decode whole against in row bands: per-rank peak memory and seconds, side by side.

    python benchmarks/vae_decode.py [--rows 1024] [--cols 1024] [--ranks 1 2 4]

The tiny AutoencoderKL of xdit_lab.tiny (channels 8 and 16, one ×2 upsampling) decodes one
latent of rows × cols: on one rank whole (diffusers' vae.decode, the reference), then on N ranks
of an sp group in bands (xdit_lab.vae). Peak: the most bytes the tensors made inside the decode
held at once (lab.measure.PeakTensorBytes; weights and the latent excluded), beside the memory
plan's closed form of it (plan.decode_peak_bytes, the largest band's). Each run also checks
the image against the whole decode (max abs difference). Ranks share this machine's cores: the
seconds are not a speedup figure here, the memory is.
"""

import argparse
import time

import torch

from xdit_lab import ParallelConfig, RankMesh
from xdit_lab.testing import run_on_ranks


def decode(world_size, rows, cols):
    from xdit_lab.lab.measure import PeakTensorBytes
    from xdit_lab.plan import decode_peak_bytes
    from xdit_lab.tiny.parts import image_vae
    from xdit_lab.vae import apply_parallel_vae

    vae = image_vae(0, 4)
    z = torch.randn(1, 4, rows, cols, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        if world_size > 1:
            apply_parallel_vae(vae, RankMesh(ParallelConfig(ulysses=world_size)))
        meter = PeakTensorBytes()
        start = time.perf_counter()
        with meter:
            image = vae.decode(z).sample
        seconds = time.perf_counter() - start
    planned = decode_peak_bytes(vae.config, tuple(z.shape), 4, bands=world_size)
    return dict(peak=meter.peak, planned=planned, seconds=seconds, corner=image[:, :, :64, :64].clone())


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--cols", type=int, default=1024)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    whole = None
    print("| ranks | peak per rank MiB | planned MiB | vs whole | seconds | max abs diff vs whole (first 64×64 px) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for n in args.ranks:
        out = run_on_ranks(decode, n, n, args.rows, args.cols, timeout_s=1800)
        peak = max(o["peak"] for o in out)
        if n == 1:
            whole = out[0]
        # without a serial run in this invocation (--ranks 2 4): no ratio and no image check
        ratio = f"{peak / whole['peak']:.2f}" if whole else "—"
        diff = f"{(out[0]['corner'] - whole['corner']).abs().max().item():.1e}" if whole else "—"
        print(
            f"| {n} | {peak / 2**20:.0f} | {out[0]['planned'] / 2**20:.0f} | {ratio} "
            f"| {max(o['seconds'] for o in out):.1f} | {diff} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
