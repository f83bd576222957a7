"""Flux's ControlNet pipeline (FluxControlNetPipeline) against diffusers' own on the same folder, run serially,
under ulysses, ring, cfg and dp, each step's bytes equal to the closed form with the ControlNet's layers in it:

    every step   ControlNet(latents, control image's latents, positive prompt) -> residuals per block
                 transformer([negative; positive], residuals for both)        -> noise, true CFG

The ControlNet is parallelized on the transformer's mesh: its residuals come out cut as the transformer cuts
its states, and nothing of them is gathered (its layers' attention is all it adds to the traffic). The scale
is 0.7 for the first half of the steps and 0 after (control_guidance_end), so both kinds of step run. The
control drops the residuals and must miss the reference; what does not run with a ControlNet yet is refused
by name before any weight is read.
"""

import re

import pytest
import torch
from forward_traffic import session_traffic, traffic_mismatches

from xdit_lab import ParallelConfig, ParallelConfigError, RankMesh, StepCache, load_pipeline
from xdit_lab.lessons.families import output_latents
from xdit_lab.testing import run_on_ranks
from xdit_lab.tiny import tiny_pipeline, tiny_pipeline_kwargs

PROMPTS = ["a red cat", "a blue dog"]
CONFIGS = [ParallelConfig(ulysses=2), ParallelConfig(ring=2), ParallelConfig(cfg=2), ParallelConfig(dp=2)]


def _picture(side: int):
    """The control image: side × side random pixels."""
    from PIL import Image

    pixels = torch.randint(0, 256, (side, side, 3), generator=torch.Generator().manual_seed(4), dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def _call(**changes):
    call = dict(tiny_pipeline_kwargs("flux"), num_inference_steps=4, negative_prompt=["", "a photo"])
    call |= dict(true_cfg_scale=2.0, control_image=_picture(16), controlnet_conditioning_scale=0.7)
    return call | dict(control_guidance_end=0.6) | changes  # guides steps 0 and 1 of 4; 0 after


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """Flux's tiny pipeline with a ControlNet of its shape (one double-stream block, two single ones), whose
    zero-initialised layers (its output projections, the control image's embedder) are given random weights:
    a trained ControlNet's are not zero, and zeros would make every residual 0."""
    from diffusers import FluxControlNetModel, FluxControlNetPipeline

    base = tiny_pipeline("flux")
    torch.manual_seed(11)
    controlnet = FluxControlNetModel.from_config({**base.transformer.config, "num_layers": 1, "num_single_layers": 2})
    for module in (controlnet.controlnet_blocks, controlnet.controlnet_single_blocks, controlnet.controlnet_x_embedder):
        for parameter in module.parameters():
            torch.nn.init.normal_(parameter, std=0.2)
    path = tmp_path_factory.mktemp("flux_controlnet")
    FluxControlNetPipeline(**base.components, controlnet=controlnet.eval()).save_pretrained(
        path, safe_serialization=True
    )
    return path


def _no_residuals(recipe) -> None:
    """The control: the transformer run without the ControlNet's residuals."""
    model_kwargs = recipe.model_kwargs

    def wrong(pipe, prepared, model_input, t):
        kwargs = model_kwargs(pipe, prepared, model_input, t)
        assert kwargs.pop("controlnet_block_samples") and kwargs.pop("controlnet_single_block_samples")
        return kwargs

    recipe.model_kwargs = wrong


def _parallel(folder, configs):
    rows = []
    for config in configs:
        pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False)
        session = pipe.session(PROMPTS, seed=0, **_call()).run()
        latents = output_latents(session.result(output_type="latent"))
        rows.append(dict(config=config.short(), latents=latents, traffic=session_traffic(session)))
    _no_residuals(pipe.recipe)
    control = output_latents(pipe(PROMPTS, seed=0, output_type="latent", **_call()))
    return rows, control


def test_flux_controlnet_equals_diffusers(folder):
    """FluxControlNetPipeline under ulysses, ring, cfg and dp against diffusers' FluxControlNetPipeline from the
    same folder, run serially (true CFG, so that cfg 2 has two branches; the ControlNet guiding the first steps
    only), within 1e-4, each step's bytes the closed form's (the ControlNet's joint layers counted)."""
    from diffusers import FluxControlNetPipeline

    reference = FluxControlNetPipeline.from_pretrained(folder)
    reference.set_progress_bar_config(disable=True)
    generator = torch.Generator().manual_seed(0)
    expected = output_latents(reference(prompt=PROMPTS, generator=generator, output_type="latent", **_call()))
    bound = 1e-4 * max(1.0, expected.abs().max().item())
    for rank, (rows, control) in enumerate(run_on_ranks(_parallel, 2, folder, CONFIGS, timeout_s=400)):
        assert [row["config"] for row in rows] == [config.short() for config in CONFIGS]
        for row in rows:
            where = f"{row['config']} rank {rank}"
            assert (row["latents"] - expected).abs().max().item() <= bound, where
            assert not traffic_mismatches(row["traffic"], where), traffic_mismatches(row["traffic"], where)
            assert all(step["moved"] for step in row["traffic"]), where
        assert (control - expected).abs().max().item() > 10 * bound


CONTROLNET_ONLY = ("controlnet_conditioning_scale", "control_guidance_end")  # what _call sets beside the image


def _refusals(folder):
    def told(call):
        try:
            call()
        except (ValueError, NotImplementedError, ParallelConfigError) as error:
            return f"{type(error).__name__}: {error}"

    pipe = load_pipeline(folder, progress=False)
    plain = load_pipeline(folder, progress=False, pipeline_class="FluxPipeline")
    planned = pipe.memory_plan_for(PROMPTS, **_call()).activation_bytes.get("image inputs")
    control = pipe.session(PROMPTS, seed=0, **_call()).prepared.extra["control"]
    return dict(
        pipefusion=told(lambda: load_pipeline(folder, ParallelConfig(pipefusion=2), progress=False)),
        compile=told(lambda: load_pipeline(folder, progress=False, compile="aot_eager")),
        cache=told(lambda: load_pipeline(folder, progress=False, cache=StepCache(0.1))),
        no_control_image=told(lambda: pipe.session(PROMPTS, **_call(control_image=None))),
        window=told(lambda: pipe.session(PROMPTS, **_call(control_guidance_start=0.8, control_guidance_end=0.5))),
        plain_image=told(
            lambda: plain.session(PROMPTS, **{k: v for k, v in _call().items() if k not in CONTROLNET_ONLY})
        ),
        plain_scale=told(lambda: plain.session(PROMPTS, **_call(control_image=None))),
        image_inputs=(planned and planned[1], control.numel() * control.element_size()),
    )


def test_what_a_controlnet_does_not_run_with_is_refused_by_name(folder):
    """PipeFusion, compile and a StepCache with a ControlNet, refused at load; a ControlNet pipeline without a control image, a
    guidance window that is empty, and a control image or a ControlNet's scale given to FluxPipeline, refused
    before anything runs. The memory plan's image inputs count the control image's latents a session keeps.
    (On a spawned rank: load_pipeline joins a torch.distributed world in the process that calls it.)"""
    (told,) = run_on_ranks(_refusals, 1, folder, timeout_s=300)
    assert re.match(
        r"ParallelConfigError: FluxControlNetPipeline does not run under PipeFusion: its ControlNet", told["pipefusion"]
    )
    assert re.match(r"ParallelConfigError: this pipeline runs a ControlNet, .* not yet with compile", told["compile"])
    assert re.match(r"ParallelConfigError: FluxControlNetPipeline does not run with a StepCache: its", told["cache"])
    assert re.match(
        r"ValueError: FluxControlNetPipeline is guided by a control image: give control_image=",
        told["no_control_image"],
    )
    assert re.match(
        r"ValueError: give controlnet_conditioning_scale as one number .* 0 <= control_guidance_start", told["window"]
    )
    assert re.match(r"ValueError: FluxPipeline takes no control_image", told["plain_image"])
    assert re.match(
        r"ValueError: FluxPipeline runs no ControlNet and takes no controlnet_conditioning_scale or control_guidance_end",
        told["plain_scale"],
    )
    planned, kept = told["image_inputs"]
    assert planned == kept > 0, told["image_inputs"]
