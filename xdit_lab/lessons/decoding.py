"""Tutorial 13 (the VAE in parallel): the decode's memory, measured on the engines.

decode_peak(rows, sp)        (engine) the digits VAE decodes one rows × rows latent, whole or in
                             bands over an sp group of `sp` ranks: the peak bytes of the tensors
                             it made, the memory plan's closed form of it, the latent's and the
                             image's bytes
decode_bytes_table(summaries)  per rank: images, latent rows, bytes out per collective of the decode
own_work_table(summaries)    per rank: the prompts it encoded, the images it decoded, the bytes its
                             encode and decode sent
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
