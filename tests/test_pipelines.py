"""Parallel pipelines against diffusers' own pipeline loaded from the same folder, run serially.

Each family's tiny pipeline is saved once as a diffusers folder. On every rank, the stock
diffusers pipeline produces the reference latents; then load_pipeline runs the same arguments
under each configuration: max abs error <= 1e-4 · max(1, max |reference|) in float32."""

import pytest
import torch

from xdit_lab import ParallelConfig, RankMesh, load_pipeline
from xdit_lab.testing import run_on_ranks
from xdit_lab.tiny import save_tiny_pipeline, tiny_pipeline_kwargs

FAMILIES = ["pixart", "sd3", "flux", "cogvideox"]
CONFIGS = {1: [ParallelConfig()],
           2: [ParallelConfig(ulysses=2), ParallelConfig(ring=2), ParallelConfig(cfg=2), ParallelConfig(dp=2)],
           4: [ParallelConfig(ulysses=2, ring=2), ParallelConfig(cfg=2, ulysses=2), ParallelConfig(dp=2, ring=2),
               ParallelConfig(cfg=2, dp=2)]}
PROMPTS, NEGATIVES = ["a red cat", "a blue dog"], ["", "a photo"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {family: save_tiny_pipeline(family, tmp_path_factory.mktemp(family)) for family in FAMILIES}


def _call_kwargs(family):
    kwargs = dict(tiny_pipeline_kwargs(family), num_inference_steps=3)
    if family == "flux":
        kwargs.setdefault("true_cfg_scale", 2.0)  # real CFG, so that cfg 2 has two branches to split
    return kwargs


def _reference_and_parallel(folder, family, configs):
    from diffusers import DiffusionPipeline

    reference = DiffusionPipeline.from_pretrained(folder)
    reference.set_progress_bar_config(disable=True)
    kwargs = _call_kwargs(family)
    expected = reference(PROMPTS, negative_prompt=NEGATIVES, generator=torch.Generator().manual_seed(0),
                         output_type="latent", **kwargs)
    expected = (expected.frames if family == "cogvideox" else expected.images)
    rows = []
    for config in configs:
        pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False)
        result = pipe(PROMPTS, negative_prompt=NEGATIVES, seed=0, output_type="latent", **kwargs)
        latents = result.frames if family == "cogvideox" else result.images
        rows.append(dict(config=config.short(), error=(latents - expected).abs().max().item(),
                         bound=1e-4 * max(1.0, expected.abs().max().item()), shape=tuple(latents.shape),
                         expected_shape=tuple(expected.shape), groups=sorted({g for step in result.comm_per_step
                                                                              for g, b in step.items() if b})))
    return rows


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_latents_equal_diffusers_pipeline(folders, family, world_size):
    per_rank = run_on_ranks(_reference_and_parallel, world_size, folders[family], family, CONFIGS[world_size],
                            timeout_s=300)
    for rank, rows in enumerate(per_rank):
        for row in rows:
            where = f"{family} {row['config']} rank {rank}"
            assert row["shape"] == row["expected_shape"], where
            assert row["error"] <= row["bound"], f"{where}: {row['error']:.3g} > {row['bound']:.3g}"
            config = next(c for c in CONFIGS[world_size] if c.short() == row["config"])
            expected_groups = {g for g in ("ulysses", "ring", "cfg", "dp") if getattr(config, g) > 1}
            assert expected_groups <= set(row["groups"]), where
