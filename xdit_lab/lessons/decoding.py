"""Tutorial 13 (the VAE in parallel): the decode's memory, measured on the engines.

decode_peak(rows, sp)        (engine) the digits VAE decodes one rows × rows latent, whole or in
                             bands over an sp group of `sp` ranks: the peak bytes of the tensors
                             it made, the memory plan's closed form of it, the latent's and the
                             image's bytes
decode_bytes_table(summaries)  per rank: images, latent rows, bytes out per collective of the decode
own_work_table(summaries)    per rank: the prompts it encoded, the images it decoded, the bytes its
                             encode and decode sent
video_bands(frames, rows, sp)  (engine) a tiny Wan VAE decodes one video of `frames` latent frames of
                             `rows` rows, in bands over an sp group of `sp` ranks: the latent rows its
                             decoder saw at each call, the halo bytes it sent against their closed form,
                             the largest difference from `vae.decode` of the whole latent (and its bound),
                             and the decode peak measured and planned, whole and banded
video_bands_table(results)   per rank: latent rows, decoder calls, halo bytes and formula, difference
"""

from __future__ import annotations

from ..lab.table import text_table


def decode_peak(rows: int, sp: int) -> dict:
    import torch
    from diffusers import AutoencoderKL

    from ..config import ParallelConfig
    from ..lab.measure import PeakTensorBytes
    from ..mesh import RankMesh
    from ..model_folder import BUNDLED
    from ..plan import decode_peak_bytes
    from ..vae import apply_parallel_vae

    vae = AutoencoderKL.from_pretrained(BUNDLED["digits"] / "vae").eval()
    mesh = RankMesh(ParallelConfig(ulysses=sp)) if sp > 1 else None
    latent = torch.randn(1, vae.config.latent_channels, rows, rows, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        if mesh is not None:
            apply_parallel_vae(vae, mesh)
        with PeakTensorBytes() as meter:
            image = vae.decode(latent).sample
    if mesh is not None:
        mesh.close()
    planned = decode_peak_bytes(vae.config, tuple(latent.shape), 4, bands=sp)
    return dict(peak=meter.peak, planned=planned, latent=latent.numel() * 4, image=image.numel() * 4)


def decode_bytes_table(summaries) -> str:
    tags = ("vae_halo", "vae_norm", "vae_kv", "vae_gather")
    rows = []
    for s in sorted((s for s in summaries if s is not None), key=lambda s: s["rank"]):
        d = s["decode"]
        by_tag = {tag: sum(n for key, n in d["bytes"].items() if key.endswith(":" + tag)) for tag in tags}
        rows.append(
            [str(s["rank"]), str(d["images"]), f"{d['band'][0]}-{d['band'][1] - 1}"]
            + [f"{by_tag[t]:,}" for t in tags]
            + [f"{d['halo_expected']:,}"]
        )
    header = ["rank", "images", "latent rows", *tags, "halo formula"]
    return text_table(header, rows)


def own_work_table(summaries) -> str:
    rows = []
    for s in sorted((s for s in summaries if s is not None), key=lambda s: s["rank"]):
        prompts, decode = s["encode"]["prompts"], s["decode"]
        first = decode.get("first_image", 0)
        images = list(range(first, first + decode["images"])) if decode["parallel"] else "all"
        rows.append(
            [
                str(s["rank"]),
                str(s["coords"]["dp"]),
                str(prompts) if prompts else "none (a stand-in)",
                str(images),
                f"{sum(s['encode']['bytes'].values()):,}",
                f"{sum(decode['bytes'].values()):,}",
            ]
        )
    header = ["rank", "dp group", "prompts encoded", "images decoded", "encode bytes", "decode bytes"]
    return text_table(header, rows)


def video_bands(frames: int, rows: int, sp: int, cols: int = 6) -> dict:
    import torch

    from ..comm import comm_log
    from ..config import ParallelConfig
    from ..lab.measure import PeakTensorBytes
    from ..mesh import RankMesh
    from ..plan import wan_decode_peak_bytes
    from ..sharding import shard_range
    from ..tiny.vaes import wan_vae
    from ..vae import apply_parallel_vae, causal_halo_bytes

    vae = wan_vae(0, 4)  # Wan 2.1's causal 3D VAE at its smallest: 8× rows, 4× frames
    latent = torch.randn(1, 4, frames, rows, cols, generator=torch.Generator().manual_seed(0))
    mesh = RankMesh(ParallelConfig(ulysses=sp))
    me = mesh.group_rank("sp")
    seen = []  # the latent rows diffusers' decoder runs on, one call per latent frame
    vae.decoder.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[-2]))
    with torch.no_grad():
        with PeakTensorBytes() as whole_meter:
            whole = vae.decode(latent).sample
        seen.clear()
        apply_parallel_vae(vae, mesh)
        with comm_log() as log, PeakTensorBytes() as band_meter:
            video = vae.decode(latent).sample
    mesh.close()
    neighbours = (me > 0) + (me < sp - 1)
    return dict(
        band=shard_range(rows, sp, me),
        calls=list(seen),
        halo=sum(r.bytes_out for r in log.records if r.tag == "vae_halo"),
        halo_expected=causal_halo_bytes(vae.config, tuple(latent.shape), 4, neighbours),
        difference=float((video - whole).abs().max()),
        bound=1e-4 * max(1.0, float(whole.abs().max())),
        frames=tuple(video.shape[2:]),
        peak_whole=whole_meter.peak,
        peak_band=band_meter.peak,
        planned_whole=wan_decode_peak_bytes(vae.config, tuple(latent.shape), 4),
        planned_band=wan_decode_peak_bytes(vae.config, tuple(latent.shape), 4, bands=sp),
    )


def video_bands_table(results: dict) -> str:
    rows = []
    for rank, r in sorted(results.items()):
        start, stop = r["band"]
        rows.append(
            [
                str(rank),
                f"{start}-{stop - 1}",
                f"{len(r['calls'])} × {r['calls'][0]} rows",
                f"{r['halo']:,}",
                f"{r['halo_expected']:,}",
                f"{r['difference']:.1e} (bound {r['bound']:.1e})",
            ]
        )
    header = ["rank", "latent rows", "decoder calls", "halo bytes", "halo formula", "max |band - whole|"]
    return text_table(header, rows)
