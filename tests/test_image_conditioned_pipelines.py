"""Pipelines that start from an image, against diffusers' own pipeline on the same folder, run serially, under
ulysses, ring, cfg and PipeFusion (every step a warmup step: exact), each step's bytes equal to the closed form:

    Wan 2.2 TI2V 5B   text to video (WanPipeline) and image to video (WanImageToVideoPipeline), expand_timesteps:
                      a timestep per token, the image's frame held at timestep 0
    Wan 2.1 I2V       image to video (WanImageToVideoPipeline): the image's latents and mask on the channels,
                      CLIP's embeddings of it before the text in the cross-attention's context
    Wan 2.2 I2V A14B  the same channels, no CLIP, two experts switching at boundary_ratio
    Flux.1            image to image (FluxImg2ImgPipeline) and inpainting (FluxInpaintPipeline), loaded from a
                      FluxPipeline folder with pipeline_class

Each has a control, a deliberately wrong variant that must miss the reference; and what a pipeline cannot take
(an image where none is taken, none where one is) is refused by name before anything runs.
"""

import json
import re

import pytest
import torch
from forward_traffic import session_traffic, traffic_mismatches

from xdit_lab import ParallelConfig, ParallelConfigError, RankMesh, load_pipeline
from xdit_lab.lessons.families import output_latents
from xdit_lab.testing import run_on_ranks
from xdit_lab.tiny import (
    save_tiny_pipeline,
    tiny_pipeline,
    tiny_pipeline_kwargs,
    tiny_transformer,
    tiny_wan_2_1_image_to_video,
)

# ---- Wan 2.2 TI2V 5B's pipelines: text to video (WanPipeline) and image to video (WanImageToVideoPipeline) ----
PROMPTS = ["a red cat", "a blue dog"]
CONFIGS = [
    ParallelConfig(ulysses=2),
    ParallelConfig(ring=2),
    ParallelConfig(cfg=2),
    ParallelConfig(pipefusion=2, warmup_steps=3),  # every step a warmup step: exact
]


def _picture(side: int):
    """The image a pipeline starts from: side × side random pixels."""
    from PIL import Image

    pixels = torch.randint(0, 256, (side, side, 3), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def _wan_call(task):
    call = dict(tiny_pipeline_kwargs("wan"), num_inference_steps=3, negative_prompt=["", "a photo"])
    if task == "image to video 2.1":  # its attention takes the context's last 512 tokens as the text
        call["max_sequence_length"] = 512
    return call | {"image": _picture(64)} if task.startswith("image to video") else call


def _wan_folders(root) -> dict:
    """Wan's tiny pipeline with expand_timesteps, as Wan 2.2 TI2V 5B's folder sets it, once as WanPipeline and
    once as WanImageToVideoPipeline (no CLIP image encoder: TI2V's transformer takes no image embeddings); and
    Wan 2.1 I2V's layout: a transformer taking the noise, the image's mask and latents on its channels and CLIP
    image embeddings (image_dim, with the image's own key and value projections), a CLIP vision tower."""
    from diffusers import WanImageToVideoPipeline

    text_to_video = tiny_pipeline("wan")
    text_to_video.register_to_config(expand_timesteps=True)
    parts = {k: v for k, v in text_to_video.components.items() if k != "transformer_2"}
    image_to_video = WanImageToVideoPipeline(**parts, image_encoder=None, image_processor=None, expand_timesteps=True)
    z, temporal = text_to_video.vae.config.z_dim, text_to_video.vae_scale_factor_temporal
    wan_2_1 = tiny_wan_2_1_image_to_video()
    experts = [  # Wan 2.2 I2V A14B: the channels as Wan 2.1's, no CLIP, two experts
        tiny_transformer("wan", seed=seed, in_channels=2 * z + temporal, out_channels=z) for seed in (0, 7)
    ]
    a14b = WanImageToVideoPipeline(
        **(parts | dict(zip(("transformer", "transformer_2"), experts))),
        image_encoder=None,
        image_processor=None,
        boundary_ratio=0.9,  # Wan 2.2 I2V A14B's: the first of 3 steps on the first expert, the others on the second
    )
    folders = dict(zip(("text to video", "image to video", "image to video 2.1", "image to video A14B"), "abcd"))
    folders = {task: root / name for task, name in folders.items()}
    for pipe, folder in zip((text_to_video, image_to_video, wan_2_1, a14b), folders.values()):
        pipe.save_pretrained(folder, safe_serialization=True)
    return folders


def _uniform_timestep(recipe) -> None:
    """The control: one timestep for every token, as if the first frame's tokens were not held at t = 0."""
    model_kwargs = recipe.model_kwargs

    def wrong(pipe, prepared, model_input, t):
        kwargs = model_kwargs(pipe, prepared, model_input, t)
        return kwargs | {"timestep": torch.full_like(kwargs["timestep"], float(t))}

    recipe.model_kwargs = wrong


def _wan_parallel(folders, configs):
    rows = []
    for task, folder in folders.items():
        for config in configs:
            pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False)
            planned = pipe.memory_plan_for(PROMPTS, **_wan_call(task)).activation_bytes  # before the call
            session = pipe.session(PROMPTS, seed=0, **_wan_call(task)).run()
            latents = output_latents(session.result(output_type="latent"))
            rows.append(
                dict(
                    task=task, config=config.short(), latents=latents, traffic=session_traffic(session),
                    **_stale_kv(pipe, planned),
                )
            )  # fmt: skip
    controls = {}
    for task, wrong in (("image to video", _uniform_timestep), ("image to video 2.1", _no_image_embeds)):
        pipe = load_pipeline(folders[task], configs[0], mesh=RankMesh(configs[0]), progress=False)
        wrong(pipe.recipe)
        controls[task] = output_latents(pipe(PROMPTS, seed=0, output_type="latent", **_wan_call(task)))
    return rows, controls


def _no_image_embeds(recipe) -> None:
    """The control for Wan 2.1: the transformer run without CLIP's image embeddings (the image on the channels
    only), as if the pipeline had dropped them."""
    model_kwargs = recipe.model_kwargs

    def wrong(pipe, prepared, model_input, t):
        kwargs = model_kwargs(pipe, prepared, model_input, t)
        assert kwargs.pop("encoder_hidden_states_image") is not None
        return kwargs

    recipe.model_kwargs = wrong


def test_wan_text_and_image_to_video_equal_diffusers(tmp_path):
    """Wan pipelines with expand_timesteps (Wan 2.2 TI2V 5B: a timestep per token), and Wan 2.1's image to video,
    under ulysses, ring, cfg and PipeFusion, against diffusers' WanPipeline and WanImageToVideoPipeline from the
    same folders, run serially. TI2V's image to video holds the first frame's tokens at timestep 0, the others
    at t: its control gives every token t. Wan 2.1's takes the image on the channels and CLIP's embeddings of it
    in the context: its control leaves the embeddings out. Each control must miss the reference. Wan 2.2 I2V
    A14B (the channels as 2.1's, two experts) runs on each strategy, PipeFusion included (each expert a stage of its
    blocks per rank: tests/test_two_experts.py). (Tokens with
    different timesteps and a strategy taking another rank's are test_per_token_arguments_follow_the_shard_exactly's
    Wan case.)"""
    from diffusers import DiffusionPipeline

    folders = _wan_folders(tmp_path)
    expected = {}
    for task, folder in folders.items():
        reference = DiffusionPipeline.from_pretrained(folder)
        assert reference.config.expand_timesteps == (task in ("text to video", "image to video")), task
        assert type(reference).__name__ == ("WanPipeline" if task == "text to video" else "WanImageToVideoPipeline")
        reference.set_progress_bar_config(disable=True)
        generator = torch.Generator().manual_seed(0)
        call = _wan_call(task)
        expected[task] = output_latents(reference(prompt=PROMPTS, generator=generator, output_type="latent", **call))
    for rank, (rows, controls) in enumerate(run_on_ranks(_wan_parallel, 2, folders, CONFIGS, timeout_s=400)):
        assert len(rows) == len(folders) * len(CONFIGS)
        for row in rows:
            where, target = f"{row['task']} {row['config']} rank {rank}", expected[row["task"]]
            bound = 1e-4 * max(1.0, target.abs().max().item())
            assert (row["latents"] - target).abs().max().item() <= bound, where
            assert not traffic_mismatches(row["traffic"], where), traffic_mismatches(row["traffic"], where)
            assert all(step["moved"] for step in row["traffic"]), where
            assert row["planned_kv"] == row["held_kv"], (where, row["planned_kv"], row["held_kv"])
            assert (row["held_kv"] > 0) == ("pf" in row["config"]), (where, row["held_kv"])
        for task, control in controls.items():
            target = expected[task]
            assert (control - target).abs().max().item() > 10 * 1e-4 * max(1.0, target.abs().max().item()), task


def _image_inputs(pipe, call) -> tuple[int | None, int]:
    """(the "image inputs" row of pipe.memory_plan_for, planned from one prompt's encode and prepare, or None
    where the plan has none; the bytes a session of the whole request keeps in those entries, counted here)."""
    plan = pipe.memory_plan_for(PROMPTS, **call).activation_bytes.get("image inputs")
    session = pipe.session(PROMPTS, seed=0, **call)
    kept = [
        session.prepared.extra.get(key)
        for key in ("reference", "inpaint", "fill", "first_frame", "image_condition", "image_embeds")
    ]
    tensors = [t for entry in kept if entry is not None for t in (entry if isinstance(entry, tuple) else (entry,))]
    return (None if plan is None else plan[1]), sum(t.numel() * t.element_size() for t in tensors)


def _stale_kv(pipe, planned) -> dict:
    """A stage's stale K/V as the request's plan said (before the call) and as the rank holds it (after): Wan 2.2
    A14B's two experts' together, of which the session frees the first's at the switch."""
    from xdit_lab.models import parallel_state

    inner = pipe.diffusers_pipeline
    experts = [t for t in (inner.transformer, getattr(inner, "transformer_2", None)) if t is not None]
    held = sum(parallel_state(t).strategy.report().kept_bytes.get("stale K/V", 0) for t in experts)
    return dict(planned_kv=planned.get("stale K/V", (0, 0))[1], held_kv=held)


def _refused(call) -> str | None:
    """What `call` is told: its error's type and message, or None where it ran."""
    try:
        call()
    except (ValueError, NotImplementedError, ParallelConfigError) as error:
        return f"{type(error).__name__}: {error}"


def _wan_refusals(folders, no_clip):
    image_to_video = load_pipeline(folders["image to video"], progress=False)
    text_to_video = load_pipeline(folders["text to video"], progress=False)
    wan_2_1, call = load_pipeline(folders["image to video 2.1"], progress=False), _wan_call("image to video 2.1")
    return dict(
        no_image=_refused(lambda: image_to_video.session(PROMPTS, **_wan_call("text to video"))),
        an_image=_refused(lambda: text_to_video.session(PROMPTS, **_wan_call("image to video"))),
        no_clip=_refused(lambda: load_pipeline(no_clip, progress=False)),
        last_image=_refused(lambda: wan_2_1.session(PROMPTS, **call, last_image=_picture(64))),
        short_text=_refused(lambda: wan_2_1.session(PROMPTS, **(call | {"max_sequence_length": 8}))),
        image_inputs=_image_inputs(image_to_video, _wan_call("image to video")),
        image_inputs_2_1=_image_inputs(wan_2_1, call),
    )


def test_an_image_is_asked_for_where_it_is_taken_and_what_wan_2_1_cannot_run_is_refused(tmp_path):
    """Image to video without image=, text to video given one: each refused by name before anything runs. Wan
    2.1's image to video: a folder whose transformer takes CLIP embeddings but has no image encoder refused at
    load; a last frame (FLF2V) and a text length other than the 512 its attention assumes refused by name.
    (On a spawned rank: load_pipeline joins a torch.distributed world in the process that calls it.)"""
    from diffusers import WanImageToVideoPipeline

    folders = _wan_folders(tmp_path)
    no_clip = WanImageToVideoPipeline.from_pretrained(
        folders["image to video 2.1"], image_encoder=None, image_processor=None
    )
    no_clip.save_pretrained(tmp_path / "no_clip", safe_serialization=True)
    (told,) = run_on_ranks(_wan_refusals, 1, folders, tmp_path / "no_clip", timeout_s=120)
    assert re.match(r"ValueError: WanImageToVideoPipeline draws a video from an image: give image=", told["no_image"])
    assert re.match(
        r"ValueError: WanPipeline draws from text alone and takes no image; image to video is", told["an_image"]
    )
    assert re.match(
        r"ValueError: WanImageToVideoPipeline's transformer takes CLIP image embeddings .* but the folder has no "
        r"image_encoder",
        told["no_clip"],
    )
    assert re.match(r"NotImplementedError: a last frame \(last_image, .* not run by xdit_lab yet", told["last_image"])
    assert re.match(r"ValueError: Wan 2.1's .* max_sequence_length must be 512, not 8", told["short_text"])
    for key in ("image_inputs", "image_inputs_2_1"):  # the first frame's latents and mask (2.1: and CLIP's embeds)
        planned, kept = told[key]
        assert planned == kept > 0, (key, told[key])


# ---- Flux.1 image to image and inpainting, loaded from a FluxPipeline folder ----------------------------------
FLUX_TASKS = {"image to image": "FluxImg2ImgPipeline", "inpaint": "FluxInpaintPipeline", "edit": "FluxKontextPipeline"}
# Kontext's reference image makes two images per sample: under PipeFusion patch i is row band i of each (all 4 of
# its steps warm; image to image and inpainting run 3)
FLUX_CONFIGS = dict.fromkeys(FLUX_TASKS, CONFIGS) | dict(
    edit=[*CONFIGS[:3], ParallelConfig(pipefusion=2, warmup_steps=4)]
)


def _mask(side: int):
    """Inpainting's mask: its left half white (redrawn), the right half black (the image's, kept)."""
    from PIL import Image

    pixels = torch.zeros(side, side, dtype=torch.uint8)
    pixels[:, : side // 2] = 255
    return Image.fromarray(pixels.numpy())


def _flux_call(task, **changes):
    call = dict(tiny_pipeline_kwargs("flux"), num_inference_steps=4, negative_prompt=["", "a photo"])
    call |= dict(true_cfg_scale=2.0, image=_picture(16))  # real CFG, so that cfg 2 has two branches
    if task == "inpaint":
        call["mask_image"] = _mask(16)
    if task == "edit":  # the size as asked (Kontext fits it to max_area: 1024² by default) and the image's own
        call |= dict(max_area=16 * 16, _auto_resize=False)
    return call | changes  # strength left out: the pipeline's default (0.6)


def _flux_parallel(folder, configs):
    from xdit_lab.families.recipe import PackedLatentsRecipe

    rows = []
    for task, pipeline_class in FLUX_TASKS.items():
        for config in configs[task]:
            pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False, pipeline_class=pipeline_class)
            planned = pipe.memory_plan_for(PROMPTS, **_flux_call(task)).activation_bytes  # before the call
            session = pipe.session(PROMPTS, seed=0, **_flux_call(task)).run()
            latents = output_latents(session.result(output_type="latent"))
            traffic, kv = session_traffic(session), _stale_kv(pipe, planned)
            rows.append(
                dict(task=task, config=config.short(), steps=session.num_steps, latents=latents, traffic=traffic, **kv)
            )
    # the controls, deliberately wrong: image to image with the strength dropped (the whole schedule from noise);
    # inpainting without putting the image's latents back after each step; editing without the reference image
    config, controls = CONFIGS[0], {}
    for task, pipeline_class in FLUX_TASKS.items():
        pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False, pipeline_class=pipeline_class)
        if task == "inpaint":
            pipe.recipe.scheduler_step = PackedLatentsRecipe.scheduler_step.__get__(pipe.recipe)
        wrong = {"image to image": dict(strength=1.0), "edit": dict(image=None)}.get(task, {})
        controls[task] = output_latents(pipe(PROMPTS, seed=0, output_type="latent", **_flux_call(task, **wrong)))
    return rows, controls


def test_flux_image_to_image_and_inpainting_equal_diffusers(tmp_path):
    """FluxImg2ImgPipeline and FluxInpaintPipeline at their default strength (0.6 of 4 steps: the last 3,
    int(4 - 2.4) skipped, from the image's latents noised to the first of them; inpainting puts the image's
    latents back where the mask is black after each step) and FluxKontextPipeline (the reference image's tokens
    after the drawn ones; under PipeFusion patch i is row band i of both images, their ids following the patches)
    under ulysses, ring, cfg and PipeFusion, against diffusers' own pipelines loaded from the same FluxPipeline
    folder; every step moves its closed form, and a stage holds the stale K/V (Kontext's: of both images) the
    request's plan said."""
    import diffusers

    folder = save_tiny_pipeline("flux", tmp_path / "flux")
    expected, steps = {}, {}
    for task, pipeline_class in FLUX_TASKS.items():
        reference = getattr(diffusers, pipeline_class).from_pretrained(folder)
        reference.set_progress_bar_config(disable=True)
        generator = torch.Generator().manual_seed(0)
        call = _flux_call(task)
        expected[task] = output_latents(reference(prompt=PROMPTS, generator=generator, output_type="latent", **call))
        steps[task] = reference.num_timesteps
        assert steps[task] < 4 or task == "edit"  # image to image skips the image's share of the schedule
    for rank, (rows, controls) in enumerate(run_on_ranks(_flux_parallel, 2, folder, FLUX_CONFIGS, timeout_s=400)):
        assert len(rows) == sum(len(configs) for configs in FLUX_CONFIGS.values())
        for row in rows:
            where, target = f"flux {row['task']} {row['config']} rank {rank}", expected[row["task"]]
            bound = 1e-4 * max(1.0, target.abs().max().item())
            assert row["steps"] == steps[row["task"]], where
            assert (row["latents"] - target).abs().max().item() <= bound, where
            assert not traffic_mismatches(row["traffic"], where), traffic_mismatches(row["traffic"], where)
            assert all(step["moved"] for step in row["traffic"]), where
            assert row["planned_kv"] == row["held_kv"], (where, row["planned_kv"], row["held_kv"])
            assert (row["held_kv"] > 0) == ("pf" in row["config"]), (where, row["held_kv"])
        for task, control in controls.items():
            target = expected[task]
            assert (control - target).abs().max().item() > 10 * 1e-4 * max(1.0, target.abs().max().item()), task


def _image_refusals(folder):
    image_to_image = load_pipeline(folder, progress=False, pipeline_class="FluxImg2ImgPipeline")
    inpaint = load_pipeline(folder, progress=False, pipeline_class="FluxInpaintPipeline")
    text_to_image = load_pipeline(folder, progress=False)
    no_image = {k: v for k, v in _flux_call("image to image").items() if k != "image"}
    return dict(
        guidance=image_to_image.request(PROMPTS, image=_picture(16)).guidance_scale,
        no_image=_refused(lambda: image_to_image.session(PROMPTS, **no_image)),
        strength_above_1=_refused(
            lambda: image_to_image.session(PROMPTS, **_flux_call("image to image", strength=1.5))
        ),
        no_step=_refused(lambda: image_to_image.session(PROMPTS, **_flux_call("image to image", strength=0.0))),
        a_mask=_refused(lambda: image_to_image.session(PROMPTS, **_flux_call("inpaint"))),
        no_mask=_refused(lambda: inpaint.session(PROMPTS, **_flux_call("image to image"))),
        an_image=_refused(lambda: text_to_image.session(PROMPTS, **_flux_call("image to image"))),
        image_inputs={
            "inpaint": _image_inputs(inpaint, _flux_call("inpaint")),
            "edit": _image_inputs(
                load_pipeline(folder, progress=False, pipeline_class="FluxKontextPipeline"), _flux_call("edit")
            ),
            "text to image": _image_inputs(
                text_to_image, {k: v for k, v in _flux_call("image to image").items() if k != "image"}
            ),
        },
    )


def test_image_inputs_are_checked_by_name(tmp_path):
    """No image, no mask, a strength outside [0, 1] or one that leaves no step, an image to the text-to-image
    pipeline, a mask to image to image, and a pipeline_class of another family: each refused by name before
    anything runs. The memory plan of a request counts the encoded images it keeps. A pipeline class's own defaults are the call's (FluxImg2ImgPipeline's
    guidance is not FluxPipeline's)."""
    import inspect

    import diffusers

    folder = save_tiny_pipeline("flux", tmp_path / "flux")
    guidance = {
        name: inspect.signature(getattr(diffusers, name).__call__).parameters["guidance_scale"].default
        for name in ("FluxPipeline", "FluxImg2ImgPipeline")
    }
    assert guidance["FluxImg2ImgPipeline"] != guidance["FluxPipeline"]
    (told,) = run_on_ranks(_image_refusals, 1, folder, timeout_s=120)
    assert told["guidance"] == guidance["FluxImg2ImgPipeline"]
    expected = dict(
        no_image=r"ValueError: FluxImg2ImgPipeline draws from an image: give image=",
        strength_above_1=r"ValueError: strength must be between 0 and 1 .*; got 1.5",
        no_step=r"ValueError: strength 0.0 of 4 steps leaves no step to run",
        a_mask=r"ValueError: FluxImg2ImgPipeline takes no mask_image; .* inpainting FluxInpaintPipeline",
        no_mask=r"ValueError: FluxInpaintPipeline redraws where its mask is white: give mask_image=",
        an_image=r"ValueError: FluxPipeline takes no image; image to image is FluxImg2ImgPipeline's",
    )
    for case, pattern in expected.items():
        assert told[case] and re.match(pattern, told[case]), (case, told[case])
    # the memory plan counts the encoded images a session keeps over the steps (inpainting's image latents, mask
    # and first noise; Kontext's reference tokens), as many bytes as the session holds; text to image has none
    for task in ("inpaint", "edit"):
        planned, kept = told["image_inputs"][task]
        assert planned == kept > 0, (task, told["image_inputs"][task])
    assert told["image_inputs"]["text to image"] == (None, 0)
    # refused before torch.distributed is joined, so in this process
    with pytest.raises(ValueError, match=r"pipeline_class='WanPipeline' is a wan pipeline, and .* holds a flux one"):
        load_pipeline(folder, progress=False, pipeline_class="WanPipeline")


# ---- Flux.2 with reference images: their tokens after the drawn ones ------------------------------------------
FLUX2_CONFIGS = [ParallelConfig(ulysses=2), ParallelConfig(ring=2), ParallelConfig(dp=2), CONFIGS[3]]
# pipeline class: (the folder's settings, the call's own arguments, the configurations); Flux2Pipeline has one
# branch, klein's base model two at guidance 2 (the references in both, as diffusers runs them), which cfg 2 splits
FLUX2_PIPELINES = dict(
    Flux2Pipeline=({}, {}, FLUX2_CONFIGS),
    Flux2KleinPipeline=({"is_distilled": False}, {"guidance_scale": 2.0}, [*FLUX2_CONFIGS, ParallelConfig(cfg=2)]),
)


def _flux2_call(own, **changes):
    """Drawn at 16² (4 × 4 tokens), beside two references of 64² (16 × 16 tokens each, ids' first axis 10, 20)."""
    images = [_picture(64), _picture(64)]
    return dict(tiny_pipeline_kwargs("flux2"), num_inference_steps=3, image=images) | own | changes


def _flux2_parallel(folder, configs, own, checks: bool = True):
    from xdit_lab.lab.summaries import rank_summary

    rows = []
    for config in configs:
        pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False)
        planned = pipe.memory_plan_for(PROMPTS, **_flux2_call(own)).activation_bytes  # before the call
        session = pipe.session(PROMPTS, seed=0, **_flux2_call(own)).run()
        latents = output_latents(session.result(output_type="latent"))
        tokens = rank_summary(session)["shard"]["tokens"]  # as the views read them
        rows.append(
            dict(
                config=config.short(), latents=latents, traffic=session_traffic(session), tokens=tokens,
                **_stale_kv(pipe, planned),
            )
        )  # fmt: skip
    if not checks:
        return rows, None, None
    control = output_latents(pipe(PROMPTS, seed=0, output_type="latent", **_flux2_call(own, image=None)))  # none
    # under PipeFusion, drawn at 128² (32 token rows) in 17 patches: a 64² reference (the pipeline's least) has 16
    config = ParallelConfig(pipefusion=2, num_patches=17)
    pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False)
    thin = _refused(lambda: pipe.request(PROMPTS, **_flux2_call(own, height=128, width=128)))
    return rows, control, thin


@pytest.mark.parametrize("pipeline_class", FLUX2_PIPELINES)
def test_flux2_reference_images_equal_diffusers(tmp_path, pipeline_class):
    """Flux2Pipeline and Flux2KleinPipeline with two reference images (their latents after the drawn ones, each
    with its own first id) under ulysses, ring, dp and PipeFusion 2 (every step a warm-up step; patch i is row band i
    of every image, the ids following the patches), and PipeFusion 2 × ulysses 2 on 4 ranks (klein's base model: cfg
    2 and cfg 2 × PipeFusion 2 too) against diffusers' own pipeline, every step moving its closed form and a stage
    holding the stale K/V the request's plan said, each stage's ranks holding every token once as the views read
    them; the control draws without them; under PipeFusion a reference of fewer token rows than patches (17 of them)
    is refused by name."""
    from diffusers import DiffusionPipeline

    settings, own, configs = FLUX2_PIPELINES[pipeline_class]
    folder = save_tiny_pipeline("flux2", tmp_path / "flux2", pipeline_class=pipeline_class, **settings)
    reference = DiffusionPipeline.from_pretrained(folder)
    reference.set_progress_bar_config(disable=True)
    generator = torch.Generator().manual_seed(0)
    called = reference(prompt=PROMPTS, generator=generator, output_type="latent", **_flux2_call(own))
    expected = output_latents(called)
    bound = 1e-4 * max(1.0, expected.abs().max().item())
    four = [ParallelConfig(pipefusion=2, ulysses=2, warmup_steps=3)]  # each patch sharded over ulysses in a stage
    four += [ParallelConfig(cfg=2, pipefusion=2, warmup_steps=3)] if own else []  # klein's base: two branches
    runs = [
        (2, rank, *result)
        for rank, result in enumerate(run_on_ranks(_flux2_parallel, 2, folder, configs, own, timeout_s=600))
    ]
    runs += [
        (4, rank, *result)
        for rank, result in enumerate(run_on_ranks(_flux2_parallel, 4, folder, four, own, False, timeout_s=600))
    ]
    held_tokens = {}
    for world, rank, rows, control, thin in runs:
        assert [row["config"] for row in rows] == [config.short() for config in (configs if world == 2 else four)]
        for row in rows:
            held_tokens.setdefault(row["config"], {})[rank] = row["tokens"]
            where = f"{pipeline_class} reference images {row['config']} rank {rank}"
            assert (row["latents"] - expected).abs().max().item() <= bound, where
            assert not traffic_mismatches(row["traffic"], where), traffic_mismatches(row["traffic"], where)
            assert all(step["moved"] for step in row["traffic"]), where
            assert row["planned_kv"] == row["held_kv"], (where, row["planned_kv"], row["held_kv"])
            assert (row["held_kv"] > 0) == ("pf" in row["config"]), (where, row["held_kv"])
        if control is None:
            continue
        assert (control - expected).abs().max().item() > 10 * bound
        assert re.match(r"ValueError: reference image 1 gives 16 token rows .* fewer than the 17 PipeFusion patches",
                        thin or ""), thin  # fmt: skip
    # PipeFusion 2 × ulysses 2: each stage's two ranks hold every token of every image once, as the views read them
    # (the drawn 4 × 4, the two references' 16 × 16 each)
    by_rank = held_tokens["pf2·ulysses2"]
    for stage in ((0, 1), (2, 3)):
        held = sorted(t for rank in stage for start, stop in by_rank[rank] for t in range(start, stop))
        assert held == list(range(16 + 2 * 16 * 16)), (stage, by_rank)


def _second_generation(folder, first, second):
    """Under stale PipeFusion (one warm-up step of three, where the patches' bands decide what each reads): the
    latents of `second` drawn after `first` on one pipeline, and drawn alone on a fresh one."""
    config = ParallelConfig(pipefusion=2, warmup_steps=1)
    latents = []
    for images in ([first, second], [second]):
        pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False)
        for image in images:
            session = pipe.session(PROMPTS, seed=0, **_flux2_call({}, image=image)).run()
        latents.append(output_latents(session.result("latent")))
        pipe.close()
    return latents


def test_a_stage_reads_each_generations_reference_grids(tmp_path):
    """A PipeFusion stage keeps the image grids it read from the ids per latent size within a generation only: a
    second generation of the same size and the same reference tokens in all, split otherwise between its references
    (256 + 768 tokens, then 512 + 512), cuts its patches from its own grids, so under stale PipeFusion it equals
    the same generation on a fresh pipeline; the first's grids would cut other bands."""
    folder = save_tiny_pipeline("flux2", tmp_path / "flux2", pipeline_class="Flux2Pipeline")
    picture = _picture(192)
    first = [picture.crop((0, 0, 64, 64)), picture.crop((0, 0, 192, 64))]
    second = [picture.crop((0, 0, 128, 64)), picture.crop((64, 0, 192, 64))]
    for rank, (after, fresh) in enumerate(run_on_ranks(_second_generation, 2, folder, first, second)):
        assert (after - fresh).abs().max().item() <= 1e-6 * max(1.0, fresh.abs().max().item()), f"rank {rank}"


# ---- Flux.1 Fill: the masked image and the mask beside the latents, on the channels ----------------------------
FILL_CONFIGS = [ParallelConfig(ulysses=2), ParallelConfig(ring=2), ParallelConfig(dp=2), CONFIGS[3]]  # one branch


def _fill_folder(root):
    """FluxFillPipeline with Flux's tiny parts and a transformer that takes [latents | masked image | mask]: 64 + 64
    packed channels and the mask's vae_scale_factor² × 4 (FLUX.1-Fill-dev: 64 + 64 + 256 = 384)."""
    from diffusers import FluxFillPipeline

    parts = tiny_pipeline("flux").components
    mask_channels = 4 * (2 ** (len(parts["vae"].config.block_out_channels) - 1)) ** 2
    transformer = tiny_transformer("flux", in_channels=2 * 64 + mask_channels, out_channels=64)
    FluxFillPipeline(
        **{k: v for k, v in parts.items() if k in FLUX_FILL_PARTS}, transformer=transformer
    ).save_pretrained(root / "fill", safe_serialization=True)
    return root / "fill"


FLUX_FILL_PARTS = ("scheduler", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")


def _fill_call(**changes):
    call = dict(tiny_pipeline_kwargs("flux"), num_inference_steps=3, image=_picture(16), mask_image=_mask(16))
    return call | changes


def _fill_parallel(folder, configs):
    from PIL import Image

    rows = []
    for config in configs:
        pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False)
        session = pipe.session(PROMPTS, seed=0, **_fill_call()).run()
        latents = output_latents(session.result(output_type="latent"))
        rows.append(dict(config=config.short(), latents=latents, traffic=session_traffic(session)))
    nothing_masked = Image.new("L", (16, 16))  # the control: the mask's channels say nothing is redrawn
    control = output_latents(pipe(PROMPTS, seed=0, output_type="latent", **_fill_call(mask_image=nothing_masked)))
    negative = _refused(lambda: pipe.session(PROMPTS, negative_prompt=["", ""], **_fill_call()))
    return rows, control, negative


def test_flux_fill_equals_diffusers(tmp_path):
    """FluxFillPipeline (its default strength 1.0 and guidance 30, the model's input) under ulysses, ring, dp and
    PipeFusion against diffusers' FluxFillPipeline from the same folder; a negative prompt is refused by name."""
    from diffusers import DiffusionPipeline

    folder = _fill_folder(tmp_path)
    reference = DiffusionPipeline.from_pretrained(folder)
    reference.set_progress_bar_config(disable=True)
    generator = torch.Generator().manual_seed(0)
    expected = output_latents(reference(prompt=PROMPTS, generator=generator, output_type="latent", **_fill_call()))
    bound = 1e-4 * max(1.0, expected.abs().max().item())
    for rank, (rows, control, negative) in enumerate(
        run_on_ranks(_fill_parallel, 2, folder, FILL_CONFIGS, timeout_s=400)
    ):
        for row in rows:
            where = f"flux fill {row['config']} rank {rank}"
            assert (row["latents"] - expected).abs().max().item() <= bound, where
            assert not traffic_mismatches(row["traffic"], where), traffic_mismatches(row["traffic"], where)
            assert all(step["moved"] for step in row["traffic"]), where
        assert (control - expected).abs().max().item() > 10 * bound
        assert negative and negative.startswith("ValueError: FluxFillPipeline takes no negative_prompt"), negative


# ---- HunyuanVideo image to video (HunyuanVideoImageToVideoPipeline): Llava sees the image, its latents start ----
HUNYUAN_CONDITIONS = ("token_replace", "latent_concat")  # HunyuanVideo-I2V's, and the channels variant
HUNYUAN_CONFIGS = [*CONFIGS, ParallelConfig(dp=2)]  # dp with two prompts, the others one prompt with true CFG


def _hunyuan_folders(root) -> dict:
    """HunyuanVideo's tiny parts with a Llava text encoder (the tiny CLIP vision tower, its image processor), once
    with a token-replace transformer and once with a latent-concat one (the noise, the image's latents and a
    mask on the channels: 2 × 4 + 1)."""
    from diffusers import HunyuanVideoImageToVideoPipeline

    from xdit_lab.tiny.encoders import llava_encoder
    from xdit_lab.tiny.tokenizers import clip_image_processor, llava_tokenizer

    text_to_video, tokenizer = tiny_pipeline("hunyuanvideo"), llava_tokenizer()
    parts = dict(text_to_video.components, tokenizer=tokenizer, text_encoder=llava_encoder(1, len(tokenizer)))
    folders = {}
    for condition in HUNYUAN_CONDITIONS:
        channels = dict(in_channels=9) if condition == "latent_concat" else {}
        transformer = tiny_transformer("hunyuanvideo", image_condition_type=condition, **channels)
        pipe = HunyuanVideoImageToVideoPipeline(
            **(parts | {"transformer": transformer}), image_processor=clip_image_processor()
        )
        pipe.save_pretrained(root / condition, safe_serialization=True)
        # its tiny size as the folder's call defaults, as save_tiny_pipeline writes a video folder's: the load plans
        # one prompt at them, where the pipeline's own 720 × 1280 × 129 frames would need 27.6 GB of tiny decode
        size = {k: v for k, v in tiny_pipeline_kwargs("hunyuanvideo").items() if k in ("height", "width")}
        (root / condition / "call_defaults.json").write_text(json.dumps(size))
        folders[condition] = root / condition
    return folders


def _hunyuan_call(prompts: int, **changes):
    """One prompt with a negative one and true CFG (diffusers' pipeline encodes one black image for the negatives:
    one prompt at a time), or two prompts without."""
    from xdit_lab.tiny.tokenizers import hunyuan_i2v_prompt_template

    call = dict(tiny_pipeline_kwargs("hunyuanvideo"), num_inference_steps=3, image=_picture(64))
    call["prompt_template"] = hunyuan_i2v_prompt_template()
    if prompts == 1:
        call |= dict(negative_prompt=["a photo"], true_cfg_scale=2.0)
    return call | changes


def _hunyuan_parallel(folders, configs):
    from xdit_lab.families.recipe import Recipe

    rows = []
    for condition, folder in folders.items():
        for config in configs:
            prompts = PROMPTS if config.dp > 1 else PROMPTS[:1]
            pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False)
            session = pipe.session(prompts, seed=0, **_hunyuan_call(len(prompts))).run()
            latents = output_latents(session.result(output_type="latent"))
            rows.append(
                dict(condition=condition, config=config.short(), latents=latents, traffic=session_traffic(session))
            )
    # the controls, deliberately wrong: token replace with frame 0 stepped like the others (not held at the
    # image's latents); latent concat with the negative prompt encoded with the image (not the black one)
    controls, config = {}, CONFIGS[0]
    for condition, folder in folders.items():
        pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False)
        recipe = pipe.recipe
        if condition == "token_replace":
            recipe.scheduler_step = Recipe.scheduler_step.__get__(recipe)
        else:
            _negative_with_the_image(recipe)
        controls[condition] = output_latents(pipe(PROMPTS[:1], seed=0, output_type="latent", **_hunyuan_call(1)))
    return rows, controls


def _negative_with_the_image(recipe) -> None:
    """The control for latent concat: the negative prompt encoded as the positive is (with the image, not black)."""
    encode_texts = recipe.encode_texts

    def wrong(pipe, request, texts, device, *, negative):
        return encode_texts(pipe, request, texts, device, negative=False)

    recipe.encode_texts = wrong


def test_hunyuanvideo_image_to_video_equals_diffusers(tmp_path):
    """HunyuanVideoImageToVideoPipeline with a token-replace transformer (HunyuanVideo-I2V's: frame 0 held at the
    image's latents, its tokens modulated at t = 0, a count each rank cuts with its tokens) and a latent-concat
    one, under ulysses, ring, cfg and PipeFusion (one prompt with true CFG: the negative branch encodes a black
    image at encode_prompt's default interleave, its text longer than the positive's, padded and masked) and dp
    (two prompts), against diffusers' pipeline from the same folder, run serially. Each condition's control must
    miss the reference; every step moves its closed form."""
    from diffusers import DiffusionPipeline

    folders = _hunyuan_folders(tmp_path)
    expected = {}
    for condition, folder in folders.items():
        reference = DiffusionPipeline.from_pretrained(folder)
        assert type(reference).__name__ == "HunyuanVideoImageToVideoPipeline"
        reference.set_progress_bar_config(disable=True)
        for prompts in (1, 2):
            call = _hunyuan_call(prompts)
            call["image"] = [call["image"]] * prompts  # diffusers' pipeline takes one image per prompt
            if prompts == 1:
                call |= dict(image=call["image"][0], negative_prompt=call["negative_prompt"][0])
            generator = torch.Generator().manual_seed(0)
            result = reference(prompt=PROMPTS[:prompts], generator=generator, output_type="latent", **call)
            expected[condition, prompts] = output_latents(result)
    results = run_on_ranks(_hunyuan_parallel, 2, folders, HUNYUAN_CONFIGS, timeout_s=400)
    for rank, (rows, controls) in enumerate(results):
        assert len(rows) == len(folders) * len(HUNYUAN_CONFIGS)
        for row in rows:
            where = f"hunyuanvideo {row['condition']} {row['config']} rank {rank}"
            target = expected[row["condition"], 2 if row["config"].startswith("dp") else 1]
            bound = 1e-4 * max(1.0, target.abs().max().item())
            assert (row["latents"] - target).abs().max().item() <= bound, where
            assert not traffic_mismatches(row["traffic"], where), traffic_mismatches(row["traffic"], where)
            assert all(step["moved"] for step in row["traffic"]), where
        for condition, control in controls.items():
            target = expected[condition, 1]
            assert (control - target).abs().max().item() > 10 * 1e-4 * max(1.0, target.abs().max().item()), condition


def _hunyuan_refusals(folders, text_to_video, wrong_transformer):
    import dataclasses

    image_to_video = load_pipeline(folders["token_replace"], progress=False)
    text_only = load_pipeline(text_to_video, progress=False)
    call, plans = _hunyuan_call(1), {}
    for condition, folder in folders.items():  # the memory plan, and the folder's closed form (plan/rows.py)
        pipe = load_pipeline(folder, progress=False)
        for prompts in (1, 2):
            measured = pipe.memory_plan_for(PROMPTS[:prompts], **_hunyuan_call(prompts)).activation_bytes
            plans[condition, prompts] = {key: measured[key][1] for key in ("latents", "conditioning")}
    return dict(
        no_image=_refused(lambda: image_to_video.session(PROMPTS[:1], **(call | {"image": None}))),
        an_image=_refused(
            lambda: text_only.session(PROMPTS, **tiny_pipeline_kwargs("hunyuanvideo"), image=_picture(64))
        ),
        interleave=_refused(
            lambda: text_only.session(PROMPTS, **tiny_pipeline_kwargs("hunyuanvideo"), image_embed_interleave=2)
        ),
        text_transformer=_refused(
            lambda: load_pipeline(wrong_transformer, progress=False).session(PROMPTS[:1], **call)
        ),
        image_inputs=[_image_inputs(load_pipeline(f, progress=False), _hunyuan_call(2)) for f in folders.values()],
        plans=plans,
        defaults=dataclasses.asdict(image_to_video.request(PROMPTS, image=_picture(64))),
    )


def test_hunyuanvideo_image_to_video_is_checked_and_planned(tmp_path):
    """Image to video without image=, text to video given an image or an image_embed_interleave, and an
    image-to-video folder whose transformer takes no image (image_condition_type None): each refused by name
    before anything runs. The memory plan counts the image's latents kept over the steps (token replace: frame
    0's; latent concat: every frame's and the mask), as many bytes as the session holds; the planner's closed
    form from the folder alone (plan/rows.py) equals the latents and conditioning the encode holds, one prompt
    with true CFG (the negative's longer text) and two without. The call's defaults are the pipeline class's."""
    import shutil

    from xdit_lab.plan import plan_model

    folders = _hunyuan_folders(tmp_path)
    text_to_video = save_tiny_pipeline("hunyuanvideo", tmp_path / "text")
    wrong_transformer = tmp_path / "wrong"
    shutil.copytree(folders["token_replace"], wrong_transformer)
    shutil.rmtree(wrong_transformer / "transformer")
    shutil.copytree(text_to_video / "transformer", wrong_transformer / "transformer")
    (told,) = run_on_ranks(_hunyuan_refusals, 1, folders, text_to_video, wrong_transformer, timeout_s=200)
    expected = dict(
        no_image=r"ValueError: HunyuanVideoImageToVideoPipeline draws a video from an image: give image=",
        an_image=r"ValueError: HunyuanVideoPipeline draws from text alone and takes no image; image to video is",
        interleave=r"ValueError: HunyuanVideoPipeline takes no image_embed_interleave",
        text_transformer=r"ValueError: HunyuanVideoImageToVideoPipeline needs a transformer with image_condition_type "
        r"token_replace or latent_concat .* this one has None",
    )
    for case, pattern in expected.items():
        assert told[case] and re.match(pattern, told[case]), (case, told[case])
    for planned, kept in told["image_inputs"]:
        assert planned == kept > 0, told["image_inputs"]
    assert told["defaults"]["guidance_scale"] == 1.0  # the image-to-video pipeline's (text to video's: 6.0)
    for (condition, prompts), measured in told["plans"].items():
        call = _hunyuan_call(prompts)
        options = {k: v for k, v in call.items() if k not in ("height", "width", "negative_prompt", "image")}
        row = plan_model(
            folders[condition], 1, 10**15, dtype=torch.float32, height=call["height"], width=call["width"], batch=prompts,
            use_cfg=prompts == 1, options=options,
        )[0]  # fmt: skip
        assert (row.latents, row.conditioning) == (measured["latents"], measured["conditioning"]), (condition, prompts)


# ---- Qwen-Image-Edit: the image shown to Qwen2.5-VL with the prompt, its latents after the drawn ones -----------
QWEN_EDIT_CONFIGS = [*CONFIGS[:3], ParallelConfig(dp=2), CONFIGS[3]]
QWEN_EDIT_USP = [
    ParallelConfig(ulysses=2, ring=2),
    ParallelConfig(cfg=2, pipefusion=2, warmup_steps=3),
    ParallelConfig(pipefusion=2, ulysses=2, warmup_steps=3),  # each patch sharded over ulysses within a stage
]


def _qwen_edit_folders(root) -> dict:
    """QwenImageEditPipeline (Qwen-Image-Edit: one image), and QwenImageEditPlusPipeline with a zero_cond_t
    transformer (Qwen-Image-Edit-2511: several images, their tokens modulated at t = 0)."""
    from xdit_lab.tiny import tiny_qwen_image_edit

    folders = {"edit": root / "edit", "plus": root / "plus"}
    tiny_qwen_image_edit().save_pretrained(folders["edit"], safe_serialization=True)
    tiny_qwen_image_edit(plus=True, zero_cond_t=True).save_pretrained(folders["plus"], safe_serialization=True)
    return folders


def _qwen_edit_call(task, **changes):
    """Two prompts with negative ones and true CFG, drawn at 128² (the reference at 1024² whatever is drawn): Edit
    one image of 4:3, Plus that and one of 5:8 (each its own grid of reference tokens)."""
    images = _picture(64).resize((64, 48)) if task == "edit" else [_picture(64).resize((64, 48)), _picture(40)]
    call = dict(image=images, height=128, width=128, num_inference_steps=3, true_cfg_scale=2.0)
    return call | dict(negative_prompt=["", "a photo"]) | changes


def _qwen_edit_reference(folder, task):
    """diffusers' own pipeline from the folder, serially, one prompt a call (QwenImageEditPlusPipeline takes one;
    QwenImageEditPipeline reads several prompts' images as a list, one per prompt), each from its row of the noise
    the pipeline's prepare_latents draws for both prompts with the seed."""
    from diffusers import DiffusionPipeline

    # the folders' processor is Qwen2VLImageTextProcessor, Qwen2VLProcessor without the video processor that
    # transformers cannot build without torchvision (the module says why): diffusers loads a component of a library
    # it does not know only once its module is imported (load_pipeline's folder reader imports it itself)
    import xdit_lab.tiny.qwen_vl_processor  # noqa: F401

    reference = DiffusionPipeline.from_pretrained(folder)
    reference.set_progress_bar_config(disable=True)
    call = _qwen_edit_call(task)
    channels, generator = reference.transformer.config.in_channels // 4, torch.Generator().manual_seed(0)
    noise, _ = reference.prepare_latents(None, 2, channels, 128, 128, torch.float32, "cpu", generator)
    rows = [
        reference(prompt=prompt, latents=noise[i : i + 1], output_type="latent", **(call | dict(negative_prompt=neg)))
        for i, (prompt, neg) in enumerate(zip(PROMPTS, call["negative_prompt"]))
    ]
    return torch.cat([output_latents(row) for row in rows])


def _qwen_edit_parallel(folders, configs, checks: bool):
    from xdit_lab.lab.summaries import rank_summary

    rows = []
    for task, folder in folders.items():
        for config in configs:
            pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False)
            planned = pipe.memory_plan_for(PROMPTS, **_qwen_edit_call(task)).activation_bytes  # before the call
            session = pipe.session(PROMPTS, seed=0, **_qwen_edit_call(task)).run()
            latents = output_latents(session.result(output_type="latent"))
            rows.append(
                dict(
                    task=task, config=config.short(), latents=latents, traffic=session_traffic(session),
                    tokens=rank_summary(session)["shard"]["tokens"],
                    **_qwen_edit_planned_and_held(pipe, session, planned),
                )
            )  # fmt: skip
    if not checks:
        return rows, None, None
    # a reference image of one token row (200:1, 14496 × 64 pixels as the pipeline encodes it), for 2 patches
    thin = [_picture(64), _picture(64).resize((200, 1))]
    too_thin = _refused(lambda: pipe.request(PROMPTS, **_qwen_edit_call("plus", image=thin)))
    # the control: Plus shown its first image alone (one grid of reference tokens, not two)
    first = _qwen_edit_call("plus")["image"][:1]
    control = output_latents(pipe(PROMPTS, seed=0, output_type="latent", **_qwen_edit_call("plus", image=first)))
    loaded = {
        task: load_pipeline(f, configs[0], mesh=RankMesh(configs[0]), progress=False) for task, f in folders.items()
    }
    told = dict(
        no_image=_refused(lambda: loaded["edit"].session(PROMPTS, **_qwen_edit_call("edit", image=None))),
        a_list=_refused(lambda: loaded["edit"].session(PROMPTS, **_qwen_edit_call("plus"))),
        # longer than max_sequence_length (512), which the edit pipelines never cut a prompt to: not refused
        long_prompt=_refused(lambda: loaded["edit"].request(["a" + " a" * 600] * 2, **_qwen_edit_call("edit"))),
        image_inputs=[_image_inputs(pipe, _qwen_edit_call(task)) for task, pipe in loaded.items()],
        too_thin=too_thin,
    )
    return rows, control, told


def _qwen_edit_planned_and_held(pipe, session, planned) -> dict:
    """The request's plan, made before the call, beside what the rank kept: latents, conditioning and, under
    PipeFusion, the stale K/V of every image's tokens, counted tensor by tensor."""
    from xdit_lab.models import parallel_state

    kept = dict(latents=[session.prepared.latents], conditioning=session.prepared.conditioning.values())
    held = {name: sum(t.numel() * t.element_size() for t in tensors) for name, tensors in kept.items()}
    held.update(parallel_state(pipe.diffusers_pipeline.transformer).strategy.report().kept_bytes)
    return dict(planned={name: planned[name][1] for name in held}, held=held)


@pytest.fixture(scope="module")
def qwen_edit(tmp_path_factory):
    """The two edit folders, and diffusers' own pipelines' latents from each, run serially."""
    folders = _qwen_edit_folders(tmp_path_factory.mktemp("qwen-edit"))
    return folders, {task: _qwen_edit_reference(folder, task) for task, folder in folders.items()}


def test_qwen_image_edit_equals_diffusers(qwen_edit):
    """QwenImageEditPipeline (one image) and QwenImageEditPlusPipeline with Qwen-Image-Edit-2511's zero_cond_t (two
    images, img_shapes listing three grids a sample, the references' tokens modulated at t = 0) under ulysses,
    ring, cfg, dp and PipeFusion 2 (every step a warm-up step; patch i is row band i of every image) on 2 ranks,
    and ulysses 2 × ring 2, cfg 2 × PipeFusion 2 and PipeFusion 2 × ulysses 2 on 4, against diffusers' own
    pipelines from the same folders, run serially; every step moves its closed form. The control, Plus shown one of
    its two images, must miss. An edit without an image, Edit given a list, the text-to-image pipeline given an
    image, and under PipeFusion a reference image with fewer token rows than patches are refused by name, a prompt
    longer than max_sequence_length is not (the edit pipelines cut none). Each request's memory plan is what the
    rank kept: latents, conditioning, the reference tokens, and a stage's stale K/V."""
    folders, expected = qwen_edit
    runs = [
        *[(rank, *result) for rank, result in enumerate(
            run_on_ranks(_qwen_edit_parallel, 2, folders, QWEN_EDIT_CONFIGS, True, timeout_s=600)
        )],
        *[(rank, *result) for rank, result in enumerate(
            run_on_ranks(_qwen_edit_parallel, 4, folders, QWEN_EDIT_USP, False, timeout_s=600)
        )],
    ]  # fmt: skip
    held_tokens = {}
    for rank, rows, control, told in runs:
        for row in rows:
            held_tokens.setdefault((row["task"], row["config"]), {})[rank] = row["tokens"]
            where, target = f"qwen-image {row['task']} {row['config']} rank {rank}", expected[row["task"]]
            bound = 1e-4 * max(1.0, target.abs().max().item())
            assert (row["latents"] - target).abs().max().item() <= bound, where
            assert not traffic_mismatches(row["traffic"], where), traffic_mismatches(row["traffic"], where)
            assert all(step["moved"] for step in row["traffic"]), where
            # the request's plan, made before the call (the text's vision tokens measured), is what the rank kept
            assert row["planned"] == row["held"], f"{where}: planned {row['planned']}, held {row['held']}"
        if control is None:
            continue
        target = expected["plus"]
        assert (control - target).abs().max().item() > 10 * 1e-4 * max(1.0, target.abs().max().item())
        assert re.match(r"ValueError: QwenImageEditPipeline edits an image: give image=", told["no_image"]), told
        assert re.match(r"ValueError: QwenImageEditPipeline edits one image, .* not a list of 2", told["a_list"]), told
        assert told["long_prompt"] is None, told["long_prompt"]
        for planned, kept in told["image_inputs"]:
            assert planned == kept > 0, told["image_inputs"]
        assert re.match(r"ValueError: reference image 2 gives 1 token rows .* fewer than the 2 PipeFusion patches",
                        told["too_thin"] or ""), told["too_thin"]  # fmt: skip
    # PipeFusion 2 × ulysses 2: each stage's two ranks hold every token of every image once, as the views read them
    # (the drawn 2 × 2, the 4:3 image's 14 × 18, the square one's 16 × 16)
    for task, tokens in (("edit", 4 + 14 * 18), ("plus", 4 + 14 * 18 + 16 * 16)):
        by_rank = held_tokens[(task, "pf2·ulysses2")]
        for stage in ((0, 1), (2, 3)):
            held = sorted(t for rank in stage for start, stop in by_rank[rank] for t in range(start, stop))
            assert held == list(range(tokens)), (task, stage, by_rank)
    # the text-to-image pipeline given an image: refused by the recipe's check of the request, naming the edit ones
    from xdit_lab.families import RECIPES, Request

    recipe = RECIPES["QwenImagePipeline"]
    request = Request(PROMPTS, None, 2, None, None, None, 0, options=recipe.check_options(dict(image=_picture(64))))
    with pytest.raises(ValueError, match=r"QwenImagePipeline draws from text alone and takes no image; editing is"):
        recipe.check_inputs(tiny_pipeline("qwenimage"), request)


# Stale PipeFusion on the edits (2 stages, 2 patches, 1 warm-up step of 3): the relative L2 of the final latents from
# diffusers' serial pipeline, measured here (torch 2.13 CPU; the runs are deterministic), bounded at 1.25 × it as
# tests/test_pipefusion.py bounds each family's forward. Measured, real / read before write / zeros: Edit 3.72e-4 /
# 8.0e-4 / 9.3e-3; Plus (zero_cond_t, two references) 2.69e-5 / 3.85e-5 / 1.05e-2 (its reference tokens, most of the
# sequence and modulated at t = 0, hardly change between steps, so their one-step-old K/V hardly differ).
QWEN_EDIT_STALE = ParallelConfig(pipefusion=2, warmup_steps=1)
QWEN_EDIT_STALE_L2 = dict(edit=3.72e-4, plus=2.69e-5)
STALE_MARGIN = 1.25


def _qwen_edit_stale(folders):
    """Each edit under stale PipeFusion and the subtle wrong buffer (each patch reading its own K/V from the step
    before), Plus also under zeros for the stale K/V and under the async schedule: latents, traffic, the plan."""
    from xdit_lab.lessons.controls import wrong_stale_kv

    runs = [(task, QWEN_EDIT_STALE, control) for task in folders for control in (None, "read before write")]
    runs += [("plus", QWEN_EDIT_STALE, "zeros"), ("plus", ParallelConfig(pipefusion=2, warmup_steps=1,
             pipefusion_schedule="async"), None)]  # fmt: skip
    rows = []
    for task, config, control in runs:
        pipe = load_pipeline(
            folders[task], config, mesh=RankMesh(config), progress=False, controls=wrong_stale_kv(control)
        )
        planned = pipe.memory_plan_for(PROMPTS, **_qwen_edit_call(task)).activation_bytes
        session = pipe.session(PROMPTS, seed=0, **_qwen_edit_call(task)).run()
        latents = output_latents(session.result(output_type="latent"))
        rows.append(
            dict(
                task=task, config=config, control=control, latents=latents, traffic=session_traffic(session),
                **_qwen_edit_planned_and_held(pipe, session, planned),
            )
        )  # fmt: skip
    return rows


def test_qwen_image_edit_stale_pipefusion_is_measured(qwen_edit):
    """PipeFusion past its warm-up on both edit pipelines: the steps after the first read the other patch's
    one-step-old K/V, the references' included; the result moves from diffusers' serial pipeline (by far more than
    the float32 noise of the exact runs, about 1e-7) by at most 1.25 × the relative L2 measured here, which both
    wrong buffers exceed; the async schedule gives the drained schedule's latents (an elementwise scheduler stepped
    patch by patch reads the same stale K/V); every step's bytes are the closed form's and each stage's stale K/V
    what the request's plan said."""
    folders, expected = qwen_edit
    for rank, rows in enumerate(run_on_ranks(_qwen_edit_stale, 2, folders, timeout_s=600)):
        drained = {}
        for row in rows:
            where = f"qwen-image {row['task']} {row['config'].short()} {row['control']} rank {rank}"
            target = expected[row["task"]]
            l2 = ((row["latents"] - target).norm() / target.norm()).item()
            bound = STALE_MARGIN * QWEN_EDIT_STALE_L2[row["task"]]
            if row["control"] is not None:
                assert l2 > bound, f"{where}: the wrong buffer within the bound, {l2:.3g} <= {bound:.3g}"
            else:
                assert 1e-5 < l2 <= bound, f"{where}: {l2:.3g} not in (1e-5, {bound:.3g}]"
            if row["control"] is None and row["config"] == QWEN_EDIT_STALE:
                drained[row["task"]] = row["latents"]
            elif row["control"] is None:  # async
                exact = 1e-4 * max(1.0, target.abs().max().item())
                assert (row["latents"] - drained[row["task"]]).abs().max().item() <= exact, where
            assert not traffic_mismatches(row["traffic"], where), traffic_mismatches(row["traffic"], where)
            assert row["planned"] == row["held"] and row["held"]["stale K/V"] > 0, (where, row["planned"], row["held"])


# Stale PipeFusion on Flux.2 klein's base model with two references (2 stages, 2 patches, 1 warm-up step of 3, two
# branches at guidance 2): the relative L2 of the final latents from diffusers' serial pipeline, measured here (torch
# 2.13 CPU; the runs are deterministic), bounded at STALE_MARGIN × it (1.25, as the edits'). Measured, real /
# read before write / zeros: 1.80e-4 / 3.81e-4 / 2.65e-3.
KLEIN_STALE = ParallelConfig(pipefusion=2, warmup_steps=1)
KLEIN_STALE_L2 = 1.80e-4


def _klein_stale(folder, own):
    """Klein under stale PipeFusion, under the subtle wrong buffer (each patch reading its own K/V from the step
    before) and zeros for the stale K/V, and under the async schedule: latents, traffic, the stale K/V planned and
    held."""
    from xdit_lab.lessons.controls import wrong_stale_kv

    async_config = ParallelConfig(pipefusion=2, warmup_steps=1, pipefusion_schedule="async")
    runs = [(KLEIN_STALE, None), (KLEIN_STALE, "read before write"), (KLEIN_STALE, "zeros"), (async_config, None)]
    rows = []
    for config, control in runs:
        pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False, controls=wrong_stale_kv(control))
        planned = pipe.memory_plan_for(PROMPTS, **_flux2_call(own)).activation_bytes
        session = pipe.session(PROMPTS, seed=0, **_flux2_call(own)).run()
        latents = output_latents(session.result(output_type="latent"))
        rows.append(
            dict(
                config=config, control=control, latents=latents, traffic=session_traffic(session),
                **_stale_kv(pipe, planned),
            )
        )  # fmt: skip
    return rows


def test_flux2_klein_stale_pipefusion_is_measured(tmp_path):
    """Flux2KleinPipeline's base model with two reference images under PipeFusion past its warm-up: the steps after
    the first read the other patch's one-step-old K/V, the references' included; the result moves from diffusers'
    serial pipeline (by far more than the float32 noise of the exact runs) by at most STALE_MARGIN × the relative
    L2 measured here, which both wrong buffers exceed; the async schedule gives the drained schedule's latents;
    every step's bytes are the closed form's and each stage's stale K/V what the request's plan said."""
    from diffusers import DiffusionPipeline

    settings, own, _ = FLUX2_PIPELINES["Flux2KleinPipeline"]
    folder = save_tiny_pipeline("flux2", tmp_path / "klein", pipeline_class="Flux2KleinPipeline", **settings)
    reference = DiffusionPipeline.from_pretrained(folder)
    reference.set_progress_bar_config(disable=True)
    generator = torch.Generator().manual_seed(0)
    target = output_latents(reference(prompt=PROMPTS, generator=generator, output_type="latent", **_flux2_call(own)))
    bound, exact = STALE_MARGIN * KLEIN_STALE_L2, 1e-4 * max(1.0, target.abs().max().item())
    for rank, rows in enumerate(run_on_ranks(_klein_stale, 2, folder, own, timeout_s=600)):
        drained = None
        for row in rows:
            where = f"klein {row['config'].short()} {row['control']} rank {rank}"
            l2 = ((row["latents"] - target).norm() / target.norm()).item()
            if row["control"] is not None:
                assert l2 > bound, f"{where}: the wrong buffer within the bound, {l2:.3g} <= {bound:.3g}"
            elif row["config"] == KLEIN_STALE:
                assert 1e-5 < l2 <= bound, f"{where}: {l2:.3g} not in (1e-5, {bound:.3g}]"
                drained = row["latents"]
            else:  # async
                assert (row["latents"] - drained).abs().max().item() <= exact, where
            assert not traffic_mismatches(row["traffic"], where), traffic_mismatches(row["traffic"], where)
            assert row["planned_kv"] == row["held_kv"] > 0, (where, row["planned_kv"], row["held_kv"])


# ---- Z-Image image to image, loaded from a ZImagePipeline folder ------------------------------------------------
ZIMAGE_CONFIGS = [
    ParallelConfig(ulysses=2),
    ParallelConfig(ring=2),
    ParallelConfig(cfg=2),
    ParallelConfig(dp=2),
    ParallelConfig(pipefusion=2, warmup_steps=4),  # every step a warm-up step: exact
]


def _zimage_call(**changes):
    call = dict(tiny_pipeline_kwargs("zimage"), num_inference_steps=4, negative_prompt=["", "a photo"])
    return call | dict(image=_picture(16)) | changes  # strength left out: the pipeline's default (0.6)


def _zimage_parallel(folder, configs):
    rows = []
    for config in configs:
        pipe = load_pipeline(
            folder, config, mesh=RankMesh(config), progress=False, pipeline_class="ZImageImg2ImgPipeline"
        )
        session = pipe.session(PROMPTS, seed=0, **_zimage_call()).run()
        latents = output_latents(session.result(output_type="latent"))
        rows.append(
            dict(config=config.short(), steps=session.num_steps, latents=latents, traffic=session_traffic(session))
        )
    # the control, deliberately wrong: the strength dropped (the whole schedule from noise)
    control = output_latents(pipe(PROMPTS, seed=0, output_type="latent", **_zimage_call(strength=1.0)))
    text_to_image = load_pipeline(folder, ParallelConfig(dp=2), mesh=RankMesh(ParallelConfig(dp=2)), progress=False)
    no_image = {k: v for k, v in _zimage_call().items() if k != "image"}
    refused = dict(
        no_image=_refused(lambda: pipe.session(PROMPTS, **no_image)),
        no_step=_refused(lambda: pipe.session(PROMPTS, **_zimage_call(strength=0.0))),
        an_image=_refused(lambda: text_to_image.session(PROMPTS, **_zimage_call())),
    )
    return rows, control, refused


def test_zimage_image_to_image_equals_diffusers(tmp_path):
    """ZImageImg2ImgPipeline at its default strength (0.6 of 4 steps: the last 3, from the image's latents noised to
    the first of them) under ulysses, ring, cfg, dp and PipeFusion (every step a warm-up step), against diffusers'
    own pipeline loaded from the same ZImagePipeline folder; its control (strength 1, the whole schedule from noise)
    misses it. No image, a strength that leaves no step, and an image given to the text-to-image pipeline are
    refused by name."""
    import diffusers

    folder = save_tiny_pipeline("zimage", tmp_path / "zimage")
    reference = diffusers.ZImageImg2ImgPipeline.from_pretrained(folder)
    reference.set_progress_bar_config(disable=True)
    generator = torch.Generator().manual_seed(0)
    # a copy: ZImagePipeline writes each prompt's chat template into the list it is given
    call = dict(prompt=list(PROMPTS), generator=generator, output_type="latent", **_zimage_call())
    expected = output_latents(reference(**call))
    bound = 1e-4 * max(1.0, expected.abs().max().item())
    assert reference.num_timesteps == 3
    for rank, (rows, control, refused) in enumerate(
        run_on_ranks(_zimage_parallel, 2, folder, ZIMAGE_CONFIGS, timeout_s=300)
    ):
        assert [row["config"] for row in rows] == [config.short() for config in ZIMAGE_CONFIGS]
        for row in rows:
            where = f"zimage image to image {row['config']} rank {rank}"
            assert row["steps"] == 3, where
            assert (row["latents"] - expected).abs().max().item() <= bound, where
            assert not traffic_mismatches(row["traffic"], where), traffic_mismatches(row["traffic"], where)
        assert (control - expected).abs().max().item() > 10 * bound
        assert re.match(r"ValueError: ZImageImg2ImgPipeline redraws an image: give image=", refused["no_image"])
        assert re.match(r"ValueError: strength 0.0 of 4 steps leaves no step to run", refused["no_step"])
        assert re.match(
            r"ValueError: ZImagePipeline draws from text alone .* ZImageImg2ImgPipeline's", refused["an_image"]
        ), refused["an_image"]
