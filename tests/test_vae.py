"""Patch-parallel VAE decode against diffusers' own `vae.decode` of the whole latent.

A small AutoencoderKL with three up blocks (two ×2 upsamplings) and its mid-block attention
decodes latents of an odd number of rows (uneven bands) on 2, 3 and 4 sequence-parallel ranks:
equal to the whole decode within 1e-4 relative, every collective tagged vae in group sp, and
the halo bytes equal to vae.halo_bytes' closed form. The control: the same bands decoded
without halos or shared statistics (each rank decoding its band alone) differ far beyond it."""

import pytest
import torch

from xdit_lab import ParallelConfig, RankMesh, comm_log
from xdit_lab.testing import run_on_ranks
from xdit_lab.vae import apply_parallel_vae, halo_bytes

pytestmark = pytest.mark.usefixtures("one_thread")

VAE_CONFIG = dict(
    down_block_types=("DownEncoderBlock2D",) * 3,
    up_block_types=("UpDecoderBlock2D",) * 3,
    block_out_channels=(8, 16, 16),
    layers_per_block=1,
    norm_num_groups=4,
    latent_channels=4,
)


def _vae():
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    return AutoencoderKL(**VAE_CONFIG).eval()


def _decode_in_bands(config, rows, cols):
    from xdit_lab.mesh import SP
    from xdit_lab.sharding import shard_range

    vae = _vae()
    z = torch.randn(2, 4, rows, cols, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = vae.decode(z).sample
        mesh = RankMesh(config)
        start, stop = shard_range(rows, mesh.group_size(SP), mesh.group_rank(SP))
        alone = vae.decode(z[..., start:stop, :]).sample  # the control: a band decoded by itself
        assert apply_parallel_vae(vae, mesh)
        with comm_log() as log:
            image = vae.decode(z).sample
    band = slice(start * 4, stop * 4)
    return dict(
        error=(image - whole).abs().max().item(),
        bound=1e-4 * max(1.0, whole.abs().max().item()),
        control=(alone - whole[..., band, :]).abs().max().item(),
        shape=tuple(image.shape) == tuple(whole.shape),
        tags={(r.group, r.tag) for r in log.records},
        halo=sum(r.bytes_out for r in log.records if r.tag == "vae_halo"),
        neighbours=(mesh.group_rank(SP) > 0) + (mesh.group_rank(SP) < mesh.group_size(SP) - 1),
    )


@pytest.mark.parametrize(
    "config, rows",
    [(ParallelConfig(ulysses=2), 7), (ParallelConfig(ring=3), 7), (ParallelConfig(ulysses=2, ring=2), 9)],
    ids=lambda v: v.short() if isinstance(v, ParallelConfig) else f"{v}rows",
)
def test_bands_equal_the_whole_decode(config, rows):
    cols = 6
    for rank, out in enumerate(run_on_ranks(_decode_in_bands, config.world_size, config, rows, cols, timeout_s=120)):
        where = f"{config.short()} rank {rank}"
        assert out["shape"], where
        assert out["error"] <= out["bound"], f"{where}: {out['error']:.3g} > {out['bound']:.3g}"
        assert out["control"] > 100 * out["bound"], f"{where}: a band alone is not far off ({out['control']:.3g})"
        assert out["tags"] == {("sp", "vae_halo"), ("sp", "vae_norm"), ("sp", "vae_attention"), ("sp", "vae_gather")}
        assert out["halo"] == halo_bytes(VAE_CONFIG, (2, 4, rows, cols), 4, out["neighbours"]), where


def _stages_and_video():
    from xdit_lab.tiny import _video_vae

    return (
        apply_parallel_vae(_vae(), RankMesh(ParallelConfig(pipefusion=2))),
        apply_parallel_vae(_video_vae(0), RankMesh(ParallelConfig(ulysses=2))),
    )


def test_pipefusion_stages_and_3d_vaes_decode_whole():
    """PipeFusion 2 alone: no sp, dp or cfg ranks to share the decode with, each stage decodes the
    whole batch; CogVideoX's 3D VAE decodes whole on every rank (said in the log):
    apply_parallel_vae changes nothing."""
    assert run_on_ranks(_stages_and_video, 2) == [(False, False)] * 2


def _pipeline_images(folder, configs, prompts=("a red cat", "a blue dog")):
    from diffusers import DiffusionPipeline

    from xdit_lab import load_pipeline
    from xdit_lab.tiny import tiny_pipeline_kwargs

    kwargs = dict(tiny_pipeline_kwargs("pixart"), num_inference_steps=2)
    prompts = list(prompts)
    reference = DiffusionPipeline.from_pretrained(folder)
    reference.set_progress_bar_config(disable=True)
    expected = reference(prompts, generator=torch.Generator().manual_seed(0), output_type="np", **kwargs).images
    rows = []
    for config in configs:
        pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False)
        with comm_log() as log:
            images = pipe(prompts, seed=0, output_type="np", **kwargs).images
        rows.append(
            dict(
                config=repr(config),
                error=float(abs(images - expected).max()),
                vae_tags=sorted({r.tag for r in log.records if r.tag.startswith("vae")}),
                vae_groups=sorted({r.group for r in log.records if r.tag.startswith("vae")}),
            )
        )
    return rows


def test_pipeline_images_equal_diffusers_with_and_without_bands(tmp_path):
    """pipe(..., output_type="np") under ulysses 2 decodes in bands by default and equals diffusers'
    pipeline run serially; vae_parallel=False decodes whole on every rank (no vae collectives)."""
    from xdit_lab.tiny import save_tiny_pipeline

    folder = save_tiny_pipeline("pixart", tmp_path / "pixart")
    configs = [ParallelConfig(ulysses=2), ParallelConfig(ring=2, vae_parallel=False)]
    for rank, (bands, whole) in enumerate(run_on_ranks(_pipeline_images, 2, folder, configs, timeout_s=180)):
        for row in (bands, whole):
            assert row["error"] <= 1e-4, f"{row['config']} rank {rank}: {row['error']:.3g}"
        assert bands["vae_tags"] == ["vae_attention", "vae_gather", "vae_halo", "vae_norm"]
        assert whole["vae_tags"] == [] and "vae_parallel=False" in whole["config"]


def test_dp_and_cfg_ranks_decode_only_their_images(tmp_path):
    """Three prompts: dp 2 decodes 2 + 1 images, cfg 2 × dp 2 shares 3 images over 4 ranks (one
    decodes none: a stand-in, dropped), cfg 2 × ulysses 2 splits images and bands; the gathered
    images equal diffusers' pipeline run serially, and the gathers show in the dp and cfg groups."""
    from xdit_lab.tiny import save_tiny_pipeline

    folder = save_tiny_pipeline("pixart", tmp_path / "pixart")
    prompts = ("a red cat", "a blue dog", "a green car")
    for world_size, configs in (
        (2, [ParallelConfig(dp=2), ParallelConfig(cfg=2)]),
        (4, [ParallelConfig(cfg=2, dp=2), ParallelConfig(cfg=2, ulysses=2)]),
    ):
        for rank, rows in enumerate(
            run_on_ranks(_pipeline_images, world_size, folder, configs, prompts, timeout_s=240)
        ):
            for row, config in zip(rows, configs):
                assert row["error"] <= 1e-4, f"{row['config']} rank {rank}: {row['error']:.3g}"
                used = {g for g in ("dp", "cfg") if getattr(config, g) > 1} | (
                    {"sp"} if config.sp_degree > 1 else set()
                )
                assert set(row["vae_groups"]) == used, f"{row['config']} rank {rank}: {row['vae_groups']}"


def _decode_summaries(folder, config):
    from xdit_lab import load_pipeline
    from xdit_lab.lab.summaries import rank_summary
    from xdit_lab.tiny import tiny_pipeline_kwargs

    pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False)
    kwargs = dict(tiny_pipeline_kwargs("pixart"), num_inference_steps=2)
    session = pipe.session(["a red cat", "a blue dog", "a green car"], seed=0, **kwargs).run()
    before = rank_summary(session)["decode"]
    session.result(output_type="np")
    return before, rank_summary(session)


def test_summaries_record_the_decode_and_the_view_draws_it(tmp_path):
    """cfg 2 × ulysses 2, 3 images: cfg rank 0 decodes images 0-1, cfg rank 1 image 2, each in 2
    bands of 4 latent rows; the measured halo bytes equal the closed form; draw_decode draws it."""
    from xdit_lab.lab.acceleration_views import draw_decode
    from xdit_lab.tiny import save_tiny_pipeline

    folder = save_tiny_pipeline("pixart", tmp_path / "pixart")
    config = ParallelConfig(cfg=2, ulysses=2)
    outs = run_on_ranks(_decode_summaries, 4, folder, config, timeout_s=180)
    summaries = [summary for _, summary in outs]
    assert all(before is None for before, _ in outs)  # nothing decoded before result()
    for s in summaries:
        decode, where = s["decode"], f"rank {s['rank']}"
        assert decode["parallel"] and decode["image_shares"] == [2, 1], where
        assert decode["images"] == (2 if s["coords"]["cfg"] == 0 else 1), where
        assert decode["band"] == ([0, 4] if s["coords"]["ulysses"] == 0 else [4, 8]), where
        assert decode["bytes"]["sp:vae_halo"] == decode["halo_expected"] > 0, where
    fig = draw_decode(summaries)
    assert "images per dp × cfg rank [2, 1]" in fig._suptitle.get_text()
    fig.savefig(tmp_path / "decode.png", dpi=80)
    assert (tmp_path / "decode.png").stat().st_size > 1000


def test_peak_tensor_bytes_counts_what_lives_at_once():
    """The meter behind the decode's memory figures: 4 MiB tensors, two alive at most (8 MiB); kept
    alive, all three count (12 MiB)."""
    from xdit_lab.lab.measure import PeakTensorBytes

    with PeakTensorBytes() as freed:
        a = torch.ones(1024, 1024)
        b = a * 2
        del a
        c = b + 1
        del b, c
    with PeakTensorBytes() as kept:
        a = torch.ones(1024, 1024)
        b = a * 2
        c = b + 1
    assert (freed.peak, kept.peak) == (8 * 2**20, 12 * 2**20) and c.numel() == 2**20


def _band_peak(rows):
    from xdit_lab.lab.measure import PeakTensorBytes
    from xdit_lab.tiny import _vae

    vae = _vae(0, 4)
    z = torch.randn(1, 4, rows, rows, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with PeakTensorBytes() as whole:
            vae.decode(z)
        apply_parallel_vae(vae, RankMesh(ParallelConfig(ulysses=2)))
        with PeakTensorBytes() as band:
            vae.decode(z)
    return whole.peak, band.peak


def test_a_band_holds_about_half_the_decode_peak():
    """At a 128 × 128 latent (256 × 256 pixels) each of 2 ranks peaks at well under the whole
    decode's peak (measured 0.5 of 12 MiB plus the gathered image)."""
    for whole, band in run_on_ranks(_band_peak, 2, 128, timeout_s=120):
        assert band < 0.7 * whole, f"band {band / 2**20:.1f} MiB, whole {whole / 2**20:.1f} MiB"


def _freed_without_gc():
    import gc
    import weakref

    vae = _vae()
    assert apply_parallel_vae(vae, RankMesh(ParallelConfig(ulysses=2)))
    watched = weakref.ref(vae)
    gc.disable()  # reference counting only: a cycle through the new decode would keep it
    try:
        del vae
        return watched() is None
    finally:
        gc.enable()


def test_a_parallel_vae_is_freed_by_its_last_reference():
    assert run_on_ranks(_freed_without_gc, 2) == [True, True]
