"""The VAE decode whole against in row bands: per-rank peak memory and seconds, side by side.

    python benchmarks/vae_decode.py [--rows 1024] [--cols 1024] [--ranks 1 2 4]
    python benchmarks/vae_decode.py --vae wan [--frames 5] [--rows 64] [--cols 64] [--base-dim 4]

The tiny AutoencoderKL of xdit_lab.tiny (channels 8 and 16, one ×2 upsampling) decodes one
latent of rows × cols: on one rank whole (diffusers' vae.decode, the reference), then on N ranks
of an sp group in bands (xdit_lab.vae). Peak: the most bytes the tensors made inside the decode
held at once (lab.measure.PeakTensorBytes; weights and the latent excluded), beside the memory
plan's closed form of it (plan.decode_peak_bytes, the largest band's). Each run also checks
the image against the whole decode (max abs difference). Ranks share this machine's cores: the
seconds are not a speedup figure here, the memory is.

--vae wan does the same for the tiny Wan 2.1 video VAE of xdit_lab.tiny (AutoencoderKLWan: 8× rows
and cols, 4× frames, base_dim 4) on a latent of frames × rows × cols, planned by
plan.wan_decode_peak_bytes, and checks every frame. Each rank ends holding the whole video (the
bands are gathered): at base_dim 4 (4 channels beside the video's 3) and 5 latent frames of 64²
that gathered video, not a band's activations, sets the peak on 2 and 4 ranks (0.66 and 0.59 of
the whole decode's). --base-dim 32 widens every block so that the channels outweigh the video, as
in the published VAE (base_dim 96): there the peak falls as 1/ranks (0.50, 0.25).
"""

import argparse
import time

import torch

from xdit_lab import ParallelConfig, RankMesh
from xdit_lab.testing import run_on_ranks


def wan_vae(base_dim):
    """xdit_lab.tiny's Wan VAE, its blocks widened to `base_dim` channels (4 as it is)."""
    from diffusers import AutoencoderKLWan

    from xdit_lab.tiny.vaes import wan_vae

    vae = wan_vae(0, 4)
    if base_dim == vae.config.base_dim:
        return vae
    torch.manual_seed(0)
    return AutoencoderKLWan.from_config({**vae.config, "base_dim": base_dim}).eval()


def decode(world_size, kind, frames, rows, cols, base_dim):
    from xdit_lab.lab.measure import PeakTensorBytes
    from xdit_lab.plan import decode_peak_bytes, wan_decode_peak_bytes
    from xdit_lab.tiny.vaes import image_vae
    from xdit_lab.vae import apply_parallel_vae

    generator = torch.Generator().manual_seed(0)
    if kind == "wan":
        vae, plan = wan_vae(base_dim), wan_decode_peak_bytes
        z = torch.randn(1, 4, frames, rows, cols, generator=generator)
    else:
        vae, plan = image_vae(0, 4), decode_peak_bytes
        z = torch.randn(1, 4, rows, cols, generator=generator)
    with torch.no_grad():
        if world_size > 1:
            apply_parallel_vae(vae, RankMesh(ParallelConfig(ulysses=world_size)))
        meter = PeakTensorBytes()
        start = time.perf_counter()
        with meter:
            image = vae.decode(z).sample
        seconds = time.perf_counter() - start
    planned = plan(vae.config, tuple(z.shape), 4, bands=world_size)
    # a video is checked whole (every rank holds it after the gather), an image in its first 64×64 pixels
    checked = image if kind == "wan" else image[:, :, :64, :64].clone()
    return dict(peak=meter.peak, planned=planned, seconds=seconds, checked=checked if rank_zero() else None)


def rank_zero():
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vae", choices=["kl", "wan"], default="kl", help="the 2D AutoencoderKL or Wan's video VAE")
    parser.add_argument("--rows", type=int, help="latent rows (1024 for kl, 64 for wan)")
    parser.add_argument("--cols", type=int, help="latent cols (1024 for kl, 64 for wan)")
    parser.add_argument("--frames", type=int, default=5, help="latent frames (wan)")
    parser.add_argument("--base-dim", type=int, default=4, help="the Wan VAE's width (xdit_lab.tiny's: 4)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    size = 64 if args.vae == "wan" else 1024
    rows, cols = args.rows or size, args.cols or size
    whole = None
    checked = "every frame" if args.vae == "wan" else "first 64×64 px"
    print(f"| ranks | peak per rank MiB | planned MiB | vs whole | seconds | max abs diff vs whole ({checked}) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for n in args.ranks:
        out = run_on_ranks(decode, n, n, args.vae, args.frames, rows, cols, args.base_dim, timeout_s=1800)
        peak = max(o["peak"] for o in out)
        if n == 1:
            whole = out[0]
        # without a serial run in this invocation (--ranks 2 4): no ratio and no image check
        ratio = f"{peak / whole['peak']:.2f}" if whole else "—"
        diff = f"{(out[0]['checked'] - whole['checked']).abs().max().item():.1e}" if whole else "—"
        print(
            f"| {n} | {peak / 2**20:.0f} | {out[0]['planned'] / 2**20:.0f} | {ratio} "
            f"| {max(o['seconds'] for o in out):.1f} | {diff} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
