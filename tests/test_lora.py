"""load_pipeline(..., lora=[(path, scale)]): a LoRA adapter fused into the weights before the strategies
parallelize the transformer, against diffusers' own pipeline with the same adapter applied at run time (not fused:
its scale passed as joint_attention_kwargs), run serially.

The adapter is random (peft's init_lora_weights=False, so B is not zero) with alpha 8 over rank 4, kept in the
file's metadata as diffusers saves it: an adapter read without its metadata, or fused at another scale, differs."""

import pytest
import torch

from xdit_lab import ParallelConfig, RankMesh, load_pipeline
from xdit_lab.lessons.families import output_latents
from xdit_lab.lora import LoraError
from xdit_lab.testing import run_cli, run_on_ranks
from xdit_lab.tiny import save_tiny_pipeline, tiny_pipeline_kwargs

PROMPTS = ["a red cat", "a blue dog"]
SCALE = 0.7
KWARGS = dict(tiny_pipeline_kwargs("flux"), num_inference_steps=3)
CONFIGS = [  # (configuration, compile)
    (ParallelConfig(ulysses=2), False),
    (ParallelConfig(ring=2), "aot_eager"),  # compiled after fusing: dynamo's graph of the fused weights
    (ParallelConfig(pipefusion=2, warmup_steps=3), False),  # every step a warmup step: exact; each stage its share
]


TARGETS = {"flux": ["to_q", "to_k", "to_v", "to_out.0", "proj_mlp"], "sd3": ["to_q", "to_k", "to_v", "to_out.0"]}


def _folder_and_lora(tmp_path_factory, family):
    """The family's tiny folder and a LoRA file for it (attention, and Flux's MLP projections, of every block)."""
    from diffusers import DiffusionPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    root = tmp_path_factory.mktemp(family)
    folder = save_tiny_pipeline(family, root / "pipeline")
    pipe = DiffusionPipeline.from_pretrained(folder)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS[family], init_lora_weights=False)
    torch.manual_seed(1)
    pipe.transformer.add_adapter(config)
    type(pipe).save_lora_weights(
        root / "lora",
        transformer_lora_layers=get_peft_model_state_dict(pipe.transformer),
        transformer_lora_adapter_metadata=config.to_dict(),
    )
    return folder, root / "lora" / "pytorch_lora_weights.safetensors"


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    return _folder_and_lora(tmp_path_factory, "flux")


def _diffusers(folder, lora=None, scale=1.0, kwargs=KWARGS):
    """diffusers' pipeline, serial; with the LoRA loaded unfused and scaled at run time."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    extra = {}
    if lora is not None:
        pipe.load_lora_weights(lora)
        extra["joint_attention_kwargs"] = {"scale": scale}
    generator = torch.Generator().manual_seed(0)
    return output_latents(pipe(prompt=PROMPTS, generator=generator, output_type="latent", **kwargs, **extra))


def _ours(folder, lora, configs, kwargs=KWARGS):
    rows = []
    for config, compile in configs:
        pipe = load_pipeline(
            folder, config, mesh=RankMesh(config), progress=False, lora=[(str(lora), SCALE)], compile=compile
        )
        planned = pipe.memory_plan.activation_bytes["LoRA adapters"][1]
        peft_layers = sum(type(m).__module__.startswith("peft.") for m in pipe.diffusers_pipeline.transformer.modules())
        latents = output_latents(pipe(PROMPTS, seed=0, output_type="latent", **kwargs))
        rows.append(
            dict(config=f"{config.short()} {compile}", latents=latents, planned=planned, peft_layers=peft_layers)
        )
    return rows


def test_a_fused_lora_equals_diffusers_applying_it_under_ulysses_ring_and_pipefusion(flux):
    folder, lora = flux
    expected = _diffusers(folder, lora, SCALE)
    bound = 1e-4 * max(1.0, expected.abs().max().item())
    # the controls: without the adapter, and at full scale, the latents differ beyond the bound
    assert (_diffusers(folder) - expected).abs().max() > 100 * bound
    assert (_diffusers(folder, lora, 1.0) - expected).abs().max() > 100 * bound
    for rows in run_on_ranks(_ours, 2, folder, lora, CONFIGS, timeout_s=240):
        for row in rows:
            assert (row["latents"] - expected).abs().max() <= bound, row["config"]
            assert row["peft_layers"] == 0, row  # fused and unloaded: plain linear layers for the strategies
            assert row["planned"] == lora.stat().st_size, row  # the adapter, counted in the plan while fused


def test_sd3_takes_the_same_path(tmp_path_factory):
    """SD3's loader (SD3LoraLoaderMixin) under ulysses 2 and pf2, against diffusers applying the adapter unfused."""
    folder, lora = _folder_and_lora(tmp_path_factory, "sd3")
    kwargs = dict(tiny_pipeline_kwargs("sd3"), num_inference_steps=3)
    expected = _diffusers(folder, lora, SCALE, kwargs)
    bound = 1e-4 * max(1.0, expected.abs().max().item())
    assert (_diffusers(folder, kwargs=kwargs) - expected).abs().max() > 100 * bound  # the adapter matters
    configs = [(ParallelConfig(ulysses=2), False), (ParallelConfig(pipefusion=2, warmup_steps=3), False)]
    for rows in run_on_ranks(_ours, 2, folder, lora, configs, kwargs, timeout_s=240):
        for row in rows:
            assert (row["latents"] - expected).abs().max() <= bound, row["config"]
            assert row["peft_layers"] == 0, row


def test_the_cli_takes_a_lora_and_its_scale(flux, tmp_path):
    """`xdit-lab run --lora PATH=SCALE` in a plain process (a world of one, run_cli's): the latents of diffusers'
    run."""
    from xdit_lab.lessons import production

    folder, lora = flux
    argv = production.run_argv(folder, PROMPTS, ParallelConfig(), tmp_path / "out", seed=0, **KWARGS)
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    job = run_cli(
        [*argv, "--output-type", "latent", "--lora", f"{lora}={SCALE}"], torchrun=False, env=env, timeout_s=240
    )
    assert job.codes == [0], job
    expected = _diffusers(folder, lora, SCALE)
    latents = torch.load(tmp_path / "out" / "latents.pt")
    assert (latents - expected).abs().max() <= 1e-4 * max(1.0, expected.abs().max().item())


def test_what_a_lora_cannot_go_with_is_refused_before_loading(flux, tmp_path):
    folder, lora = flux
    for kwargs, said in [
        (dict(lora=[(str(lora), 1.0)], fuse_lora=False), "fuse_lora=False .* is not supported"),
        (dict(lora=[(str(lora), 1.0)], shard_weights=True), "lora with shard_weights"),
        (dict(lora=[(str(lora), 1.0)], quantization="int8"), "lora with quantization"),
        (dict(lora=[(str(tmp_path / "missing.safetensors"), 1.0)]), "no such file or folder"),
        (dict(lora=[(str(lora), "strong")]), "scale must be a number"),
    ]:
        with pytest.raises(LoraError, match=said):
            load_pipeline(folder, ParallelConfig(ulysses=2) if "shard_weights" in kwargs else None, **kwargs)
    pixart = save_tiny_pipeline("pixart", tmp_path / "pixart")
    with pytest.raises(LoraError, match="PixArtAlphaPipeline has no LoRA loader in diffusers"):
        load_pipeline(pixart, lora=[(str(lora), 1.0)])
