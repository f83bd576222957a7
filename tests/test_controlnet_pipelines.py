"""ControlNet pipelines (FluxControlNetPipeline, StableDiffusion3ControlNetPipeline) against diffusers' own on the
same folder, run serially, under ulysses, ring, cfg and dp, each step's bytes equal to the closed form with the
ControlNet's layers in it:

    Flux   ControlNet(latents, control latents, positive prompt)      -> residuals per block
           transformer([negative; positive], residuals for both)     -> noise, true CFG
    SD3    ControlNet([latents; latents], control latents, both prompts) -> residuals per block and row
           transformer([negative; positive], residuals)              -> noise, CFG

The ControlNet is parallelized on the transformer's mesh: its residuals come out cut as the transformer cuts
its states, and nothing of them is gathered (its layers' attention is all it adds to the traffic). The scale
is 0.7 for the first steps and 0 after (control_guidance_end), so both kinds of step run. The control drops
the residuals and must miss the reference; what does not run with a ControlNet yet is refused by name before
any weight is read.
"""

import re

import pytest
import torch
from forward_traffic import session_traffic, traffic_mismatches

from xdit_lab import ParallelConfig, ParallelConfigError, RankMesh, load_pipeline
from xdit_lab.lessons.families import output_latents
from xdit_lab.testing import run_on_ranks
from xdit_lab.tiny import tiny_pipeline, tiny_pipeline_kwargs, tiny_transformer

PROMPTS = ["a red cat", "a blue dog"]
CONFIGS = [ParallelConfig(ulysses=2), ParallelConfig(ring=2), ParallelConfig(cfg=2), ParallelConfig(dp=2)]
PIPELINES = {"flux": "FluxControlNetPipeline", "sd3": "StableDiffusion3ControlNetPipeline"}
# PipeFusion, every step a warmup step (exact), stages split so that the second starts inside a block list whose
# residuals differ block by block: Flux's second stage holds single-stream block 1 (its own block 0), SD3's joint
# blocks 1 and 2 of 3 (block 2, the last, takes no residual)
PIPEFUSION = {
    "flux": ParallelConfig(pipefusion=2, warmup_steps=4, stage_split=(3, 1)),
    "sd3": ParallelConfig(pipefusion=2, warmup_steps=4, stage_split=(1, 2)),
}


def _picture(side: int):
    """The control image: side × side random pixels."""
    from PIL import Image

    pixels = torch.randint(0, 256, (side, side, 3), generator=torch.Generator().manual_seed(4), dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def _call(family="flux", **changes):
    call = dict(tiny_pipeline_kwargs(family), num_inference_steps=4, negative_prompt=["", "a photo"])
    if family == "flux":
        call["true_cfg_scale"] = 2.0  # SD3 runs CFG by default (guidance_scale 7)
    call |= dict(control_image=_picture(16), controlnet_conditioning_scale=0.7)
    return call | dict(control_guidance_end=0.6) | changes  # guides steps 0 and 1 of 4; 0 after


def _controlnet(family, transformer):
    """A ControlNet of the tiny transformer's shape (Flux: one double-stream block, two single ones; SD3: three
    joint blocks, one residual for each of the transformer's), whose zero-initialised layers (its output projections, the control image's embedder) are given
    random weights: a trained ControlNet's are not zero, and zeros would make every residual 0."""
    import diffusers

    torch.manual_seed(11)
    if family == "flux":
        config = {**transformer.config, "num_layers": 1, "num_single_layers": 2}
        controlnet = diffusers.FluxControlNetModel.from_config(config)
        zeroed = (controlnet.controlnet_blocks, controlnet.controlnet_single_blocks, controlnet.controlnet_x_embedder)
    else:
        controlnet = diffusers.SD3ControlNetModel.from_config({**transformer.config, "num_layers": 3})
        zeroed = (controlnet.controlnet_blocks, controlnet.pos_embed_input)
    for module in zeroed:
        for parameter in module.parameters():
            torch.nn.init.normal_(parameter, std=0.2)
    return controlnet.eval()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Each family's tiny pipeline with a ControlNet, saved as its ControlNet pipeline."""
    import diffusers

    folders = {}
    for family, pipeline_class in PIPELINES.items():
        parts = tiny_pipeline(family).components
        if family == "sd3":  # three joint blocks: a PipeFusion stage can start at one that takes a residual
            parts["transformer"] = tiny_transformer("sd3", layers=3)
        pipe = getattr(diffusers, pipeline_class)(**parts, controlnet=_controlnet(family, parts["transformer"]))
        folders[family] = tmp_path_factory.mktemp(f"{family}_controlnet")
        pipe.save_pretrained(folders[family], safe_serialization=True)
    return folders


def _no_residuals(recipe) -> None:
    """The control: the transformer run without the ControlNet's residuals."""
    model_kwargs = recipe.model_kwargs
    keys = ("controlnet_block_samples", "controlnet_single_block_samples", "block_controlnet_hidden_states")

    def wrong(pipe, prepared, model_input, t):
        kwargs = model_kwargs(pipe, prepared, model_input, t)
        assert all(kwargs.pop(key) for key in keys if key in kwargs)
        return kwargs

    recipe.model_kwargs = wrong


def _parallel(folders, configs):
    from xdit_lab.models import Controls

    rows, controls = [], {}
    for family, folder in folders.items():
        for config in [PIPEFUSION[family], *configs]:
            pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False)
            session = pipe.session(PROMPTS, seed=0, **_call(family)).run()
            latents = output_latents(session.result(output_type="latent"))
            rows.append(dict(family=family, config=config.short(), latents=latents, traffic=session_traffic(session)))
        _no_residuals(pipe.recipe)
        controls[family] = output_latents(pipe(PROMPTS, seed=0, output_type="latent", **_call(family)))
        # PipeFusion's control: each stage's blocks given the residuals as the whole model numbers its blocks
        config, unrebased = PIPEFUSION[family], Controls(rebases_block_residuals=False)
        pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False, controls=unrebased)
        controls[family, "pipefusion"] = output_latents(pipe(PROMPTS, seed=0, output_type="latent", **_call(family)))
    return rows, controls


def test_controlnet_pipelines_equal_diffusers(folders):
    """Flux's and SD3's ControlNet pipelines under ulysses, ring, cfg, dp and PipeFusion (the ControlNet whole on
    every rank, each stage given its own blocks' residuals: its control gives them as the whole model numbers
    them) against diffusers' own from the same folders, run serially (CFG on, so that cfg 2 has two branches; the ControlNet guiding the first steps only),
    within 1e-4, each step's bytes the closed form's (the ControlNet's layers counted). diffusers' SD3 pipeline
    samples the control image's latents from torch's global generator: seeded here as xdit_lab seeds them."""
    import diffusers

    expected = {}
    for family, folder in folders.items():
        reference = getattr(diffusers, PIPELINES[family]).from_pretrained(folder)
        reference.set_progress_bar_config(disable=True)
        torch.manual_seed(0)  # SD3's control image's latents (diffusers samples them from the global generator)
        generator = torch.Generator().manual_seed(0)
        call = _call(family)
        expected[family] = output_latents(reference(prompt=PROMPTS, generator=generator, output_type="latent", **call))
    for rank, (rows, controls) in enumerate(run_on_ranks(_parallel, 2, folders, CONFIGS, timeout_s=400)):
        configs = [(f, c.short()) for f in folders for c in [PIPEFUSION[f], *CONFIGS]]
        assert [(r["family"], r["config"]) for r in rows] == configs
        for row in rows:
            where, target = f"{row['family']} {row['config']} rank {rank}", expected[row["family"]]
            bound = 1e-4 * max(1.0, target.abs().max().item())
            assert (row["latents"] - target).abs().max().item() <= bound, where
            assert not traffic_mismatches(row["traffic"], where), traffic_mismatches(row["traffic"], where)
            assert all(step["moved"] for step in row["traffic"]), where
        for case, control in controls.items():
            target = expected[case if isinstance(case, str) else case[0]]
            assert (control - target).abs().max().item() > 10 * 1e-4 * max(1.0, target.abs().max().item()), case


CONTROLNET_ONLY = ("controlnet_conditioning_scale", "control_guidance_end")  # what _call sets beside the image


# Flux's folder (SD3's ControlNet pipeline shares the checks: families/controlnet.py), SD3.5's
def _refusals(folder, sd35):
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
        pipefusion_async=told(
            lambda: load_pipeline(folder, ParallelConfig(pipefusion=2, pipefusion_schedule="async"), progress=False)
        ),
        compile=told(lambda: load_pipeline(folder, progress=False, compile="aot_eager")),
        sd35=told(lambda: load_pipeline(sd35, progress=False)),
        no_control_image=told(lambda: pipe.session(PROMPTS, **_call(control_image=None))),
        window=told(lambda: pipe.session(PROMPTS, **_call(control_guidance_start=0.8, control_guidance_end=0.5))),
        plain_image=told(
            lambda: plain.session(PROMPTS, **{k: v for k, v in _call().items() if k not in CONTROLNET_ONLY})
        ),
        plain_scale=told(lambda: plain.session(PROMPTS, **_call(control_image=None))),
        image_inputs=(planned and planned[1], control.numel() * control.element_size()),
    )


def test_what_a_controlnet_does_not_run_with_is_refused_by_name(folders, tmp_path):
    """PipeFusion's async schedule and compile with a ControlNet (a StepCache runs with one:
    tests/test_step_cache_flux2_controlnet_compile.py), and an SD3.5 ControlNet without text, refused at load; a ControlNet pipeline without a control image, a
    guidance window that is empty, and a control image or a ControlNet's scale given to FluxPipeline, refused
    before anything runs. The memory plan's image inputs count the control image's latents a session keeps.
    (On a spawned rank: load_pipeline joins a torch.distributed world in the process that calls it.)"""
    from diffusers import SD3ControlNetModel, StableDiffusion3ControlNetPipeline

    base = tiny_pipeline("sd3")  # SD3.5 Large's own ControlNet: no text, the transformer's pos_embed
    config = {**base.transformer.config, "num_layers": 1, "joint_attention_dim": None, "use_pos_embed": False}
    sd35 = StableDiffusion3ControlNetPipeline(**base.components, controlnet=SD3ControlNetModel.from_config(config))
    sd35.save_pretrained(tmp_path / "sd35", safe_serialization=True)  # its controlnet saved with the shared pos_embed:
    SD3ControlNetModel.from_config(config).save_pretrained(tmp_path / "sd35" / "controlnet")  # as published, without
    (told,) = run_on_ranks(_refusals, 1, folders["flux"], tmp_path / "sd35", timeout_s=300)
    assert re.match(
        r"ParallelConfigError: this pipeline runs a ControlNet, .* not yet with pipefusion_schedule='async'",
        told["pipefusion_async"],
    )
    assert re.match(r"ParallelConfigError: this pipeline runs a ControlNet, .* not yet with compile", told["compile"])
    assert re.match(
        r"NotImplementedError: an SD3.5 ControlNet without text .* is not run by xdit_lab yet", told["sd35"]
    )
    assert re.match(
        r"ValueError: FluxControlNetPipeline is guided by a control image: give control_image=",
        told["no_control_image"],
    )
    assert re.match(
        r"ValueError: give controlnet_conditioning_scale as one number .* 0 <= control_guidance_start", told["window"]
    )
    assert re.match(r"ValueError: FluxPipeline runs no ControlNet and takes no control_image;", told["plain_image"])
    assert re.match(
        r"ValueError: FluxPipeline runs no ControlNet and takes no controlnet_conditioning_scale or control_guidance_end",
        told["plain_scale"],
    )
    planned, kept = told["image_inputs"]
    assert planned == kept > 0, told["image_inputs"]


def _without_controlnet(folder, family):
    """The same folder as its family's plain pipeline: its model_index without the controlnet (a copy beside it)."""
    import json
    import shutil

    plain = folder.parent / f"{folder.name}_plain"
    if not plain.exists():
        shutil.copytree(folder, plain, ignore=shutil.ignore_patterns("controlnet"))
        index = json.loads((plain / "model_index.json").read_text())
        index.pop("controlnet")
        index["_class_name"] = {"flux": "FluxPipeline", "sd3": "StableDiffusion3Pipeline"}[family]
        (plain / "model_index.json").write_text(json.dumps(index))
    return plain


def test_the_planner_leaves_out_what_a_controlnet_does_not_run_with(folders):
    """plan_model on a ControlNet pipeline's folder: no sharded weights (load_pipeline refuses them), said in a
    note; PipeFusion rows, their traffic the same folder's without the ControlNet (it runs whole on every rank
    there); elsewhere the ControlNet's blocks counted in the traffic beside the transformer's (the same folder
    without the ControlNet is the control); --quantize refused by load_pipeline's words."""
    from xdit_lab.plan import plan_model

    for family, folder in folders.items():
        rows = plan_model(folder, 4, 24 * 10**9)
        assert rows and not [r for r in rows if r.shard_weights or r.text_encoders == "sharded"]
        assert any(r.config.pipefusion > 1 for r in rows)
        notes = rows[0].request.notes
        assert not any(n.startswith("no PipeFusion rows") for n in notes)
        assert any(n.startswith("no shard_weights rows: this pipeline runs a ControlNet") for n in notes)
        assert any("the ControlNet's weights are whole on every rank" in n for n in notes)
        # its blocks counted with the transformer's: the traffic of the same folder without it, times their ratio
        plain = plan_model(_without_controlnet(folder, family), 4, 24 * 10**9)
        ratio = {"flux": (4 + 3) / 4, "sd3": (3 + 3) / 3}[family]  # tiny: Flux 2 + 2 blocks and 1 + 2; SD3 3 and 3
        for row in (r for r in rows if r.config.sp_degree > 1 or r.config.pipefusion > 1):
            alone = next(p for p in plain if p.config == row.config and p.text_encoders == row.text_encoders)
            times = ratio if row.config.pipefusion == 1 else 1  # under PipeFusion the ControlNet moves nothing
            assert row.activation_traffic == round(alone.activation_traffic * times), (family, row.config)
        assert all(r.weights["controlnet"] > 0 for r in rows)
        with pytest.raises(ValueError, match=r"runs a ControlNet, .* not yet with quantization"):
            plan_model(folder, 4, 24 * 10**9, quantize="int8")
