"""Parallel pipelines against diffusers' own pipeline loaded from the same folder, run serially.

Each family's tiny pipeline is saved once as a diffusers folder, and the stock diffusers pipeline
produces its reference latents once, in the test process (one reference per family, not one per
rank and world size); then load_pipeline runs the same arguments on the ranks under each configuration: max abs error <= 1e-4 · max(1, max |reference|) in float32. Each run
also checks the request's memory plan (pipe.memory_plan_for, made before the call) against the
latents, conditioning and stale K/V the rank held between steps, and each step's bytes per group
against the closed form (xdit_lab.traffic.expected_bytes_per_step)."""

import pytest
import torch
from forward_traffic import session_traffic, traffic_mismatches

from xdit_lab import ParallelConfig, RankMesh, load_pipeline
from xdit_lab.lessons.families import output_latents
from xdit_lab.testing import run_on_ranks
from xdit_lab.tiny import save_tiny_pipeline, tiny_pipeline_kwargs

FAMILIES = [
    "pixart", "sd3", "flux", "flux2", "qwenimage", "hunyuanvideo", "cogvideox", "wan", "zimage", "sana", "hunyuanvideo15"
]  # fmt: skip
# LTX-2 is checked against LTX2Pipeline in tests/test_ltx2.py: its output is two latents (the video's and the
# audio's) where these compare one, and PipeFusion, among the configurations here, is refused for it
ONE_BRANCH = ("flux2",)  # guidance-distilled, no negative prompt: cfg 2 is refused (tested below)
# a convolution over token rows: PipeFusion runs each stage over the whole image, ulysses = ring = 1 within it
# (refused by name: tests/test_models.py)
STAGES_WHOLE = ("sana",)
CONFIGS = {
    1: [ParallelConfig()],
    2: [
        ParallelConfig(ulysses=2),
        ParallelConfig(ring=2),
        ParallelConfig(cfg=2),
        ParallelConfig(dp=2),
        ParallelConfig(pipefusion=2, warmup_steps=3),  # every step a warmup step: exact; stages load their blocks
    ],
    4: [
        ParallelConfig(ulysses=2, ring=2),
        ParallelConfig(cfg=2, ulysses=2),
        ParallelConfig(dp=2, ring=2),
        ParallelConfig(cfg=2, dp=2),
        ParallelConfig(pipefusion=2, ulysses=2, warmup_steps=3),
    ],
}
PROMPTS, NEGATIVES = ["a red cat", "a blue dog"], ["", "a photo"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {family: save_tiny_pipeline(family, tmp_path_factory.mktemp(family)) for family in FAMILIES}


def _call_kwargs(family):
    kwargs = dict(tiny_pipeline_kwargs(family), num_inference_steps=3)
    if family in ("flux", "hunyuanvideo"):
        kwargs.setdefault("true_cfg_scale", 2.0)  # real CFG, so that cfg 2 has two branches to split
    return kwargs


def _family_kwargs(family):
    kwargs = _call_kwargs(family)
    if family not in ONE_BRANCH:
        kwargs["negative_prompt"] = list(NEGATIVES)  # a copy: ZImagePipeline writes its template into it
    return kwargs


def _reference(folder, family, kwargs=None):
    """diffusers' own pipeline from the folder, run serially: the latents every configuration must give."""
    from diffusers import DiffusionPipeline

    reference = DiffusionPipeline.from_pretrained(folder)
    reference.set_progress_bar_config(disable=True)
    generator = torch.Generator().manual_seed(0)
    # a copy: ZImagePipeline writes each prompt's chat template into the list it is given
    kwargs = _family_kwargs(family) if kwargs is None else kwargs
    return output_latents(reference(prompt=list(PROMPTS), generator=generator, output_type="latent", **kwargs))


@pytest.fixture(scope="module")
def references(folders):
    return {family: _reference(folders[family], family) for family in FAMILIES}


def _parallel(folder, family, configs, expected, kwargs=None, controls=None):
    kwargs = _family_kwargs(family) if kwargs is None else kwargs
    rows = []
    for config in configs:
        pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False, controls=controls)
        planned = pipe.memory_plan_for(PROMPTS, **kwargs).activation_bytes  # before the call
        session = pipe.session(PROMPTS, seed=0, **kwargs).run()
        result = session.result(output_type="latent")
        latents = output_latents(result)
        rows.append(
            dict(
                config=config.short(),
                error=(latents - expected).abs().max().item(),
                bound=1e-4 * max(1.0, expected.abs().max().item()),
                shape=tuple(latents.shape),
                expected_shape=tuple(expected.shape),
                traffic=session_traffic(session),
                planned={
                    name: planned[name][1] for name in ("latents", "conditioning", "stale K/V") if name in planned
                },
                held=_held_between_steps(pipe, session),
                summary=_layout_summary(session) if config == ParallelConfig(ulysses=2) else None,
            )
        )
    return rows


def _layout_summary(session) -> dict:
    """What the token-layout view reads of this rank's summary."""
    from xdit_lab.lab.summaries import rank_summary

    summary = rank_summary(session)
    return {key: summary[key] for key in ("rank", "family", "grid", "image_tokens", "shapes", "shard")}


def _held_between_steps(pipe, session) -> dict[str, int]:
    """What this rank keeps from one step to the next besides the weights, counted tensor by tensor."""
    from xdit_lab.models import parallel_state

    def size(tensors):
        leaves = torch.utils._pytree.tree_leaves(list(tensors))
        return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))

    held = dict(
        latents=size([session.prepared.latents]),
        conditioning=size(session.prepared.conditioning.values()),  # each entry a tensor, or None
    )
    strategy = parallel_state(pipe.diffusers_pipeline.transformer).strategy
    held.update(strategy.report().kept_bytes)  # PipeFusion: its stale K/V buffers, counted tensor by tensor
    return held


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_latents_equal_diffusers_pipeline(folders, references, family, world_size):
    configs = [
        c
        for c in CONFIGS[world_size]
        if not (family in ONE_BRANCH and c.cfg > 1)
        and not (family in STAGES_WHOLE and c.pipefusion > 1 and c.sp_degree > 1)
    ]
    expected = references[family]
    per_rank = run_on_ranks(_parallel, world_size, folders[family], family, configs, expected, timeout_s=300)
    _check_rows(per_rank, configs, family)
    if world_size == 2:  # the ulysses 2 run: where the family's text sits, as the token-layout view draws it
        _check_token_layout(family, [next(r["summary"] for r in rows if r["summary"]) for rows in per_rank])


def _check_rows(per_rank, configs, name):
    """Every configuration ran on every rank, as exact as the bound, its traffic the closed form's, and the request's
    memory plan, made before the call, what the rank held between steps."""
    for rank, rows in enumerate(per_rank):
        assert [row["config"] for row in rows] == [config.short() for config in configs]
        for row in rows:
            where = f"{name} {row['config']} rank {rank}"
            assert row["shape"] == row["expected_shape"], where
            assert row["error"] <= row["bound"], f"{where}: {row['error']:.3g} > {row['bound']:.3g}"
            config = next(c for c in configs if c.short() == row["config"])
            _check_traffic(row, config, where)
            assert row["held"]["latents"] > 0 and row["held"]["conditioning"] > 0, where
            assert row["planned"] == row["held"], f"{where}: planned {row['planned']}, held {row['held']}"


# Flux.2 klein's two models, a tiny folder each: (the pipeline's settings its folder keeps, the call). The base
# model's true CFG at guidance 2 with negative prompts (diffusers takes them as negative_prompt_embeds), which cfg 2
# splits; the step-distilled model's one branch, its guidance ignored (cfg 2 refused: tests/test_bad_input.py)
KLEIN = dict(
    base=(dict(is_distilled=False), dict(guidance_scale=2.0, negative_prompt=NEGATIVES)),
    distilled=(dict(is_distilled=True), dict(guidance_scale=4.0)),
)


@pytest.fixture(scope="module")
def klein_folders(tmp_path_factory):
    return {
        form: save_tiny_pipeline(
            "flux2", tmp_path_factory.mktemp(f"klein-{form}"), pipeline_class="Flux2KleinPipeline", **settings
        )
        for form, (settings, _) in KLEIN.items()
    }


def _klein_call(form):
    return dict(_call_kwargs("flux2"), **KLEIN[form][1])


def _klein_reference(folder, kwargs):
    """diffusers' Flux2KleinPipeline from the folder, run serially, its negative prompts encoded by its own
    encode_prompt (its call takes them as embeddings)."""
    from diffusers import DiffusionPipeline

    reference = DiffusionPipeline.from_pretrained(folder)
    reference.set_progress_bar_config(disable=True)
    kwargs = dict(kwargs)
    if "negative_prompt" in kwargs:
        negatives = kwargs.pop("negative_prompt")
        length = kwargs["max_sequence_length"]
        kwargs["negative_prompt_embeds"] = reference.encode_prompt(negatives, max_sequence_length=length)[0]
    generator = torch.Generator().manual_seed(0)
    return output_latents(reference(prompt=PROMPTS, generator=generator, output_type="latent", **kwargs))


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("form", KLEIN)
def test_flux2_klein_equals_diffusers_pipeline(klein_folders, form, world_size):
    """Flux2KleinPipeline folders (Qwen3 text, no guidance embedding, 3 heads) through load_pipeline under every
    strategy: equal to diffusers' Flux2KleinPipeline run serially within 1e-4 relative, the base model's two branches
    split by cfg 2 too, each step's bytes the closed form's, the plan what a rank holds. Control (2 ranks): PipeFusion
    on stale K/V at every step misses the bound (measured 2.0e-4 relative on both models; one warmup step of three
    1.4e-4)."""
    kwargs = _klein_call(form)
    expected = _klein_reference(klein_folders[form], kwargs)
    configs = [c for c in CONFIGS[world_size] if form == "base" or c.cfg == 1]
    stale = [ParallelConfig(pipefusion=2, warmup_steps=0)] if world_size == 2 else []
    folder = klein_folders[form]
    runs = [*configs, *stale]
    per_rank = run_on_ranks(_parallel, world_size, folder, "flux2", runs, expected, kwargs, timeout_s=400)
    _check_rows([rows[: len(configs)] for rows in per_rank], configs, f"flux2 klein {form}")
    for rank, rows in enumerate(per_rank):
        for row in rows[len(configs) :]:
            assert row["error"] > row["bound"], f"rank {rank}: {row['config']} on stale K/V within the bound"


def _check_traffic(row, config, where):
    """Every step's bytes per group equal the closed form, and every degree above 1 moved some
    (dp with one sample per group moves nothing: not among these configurations)."""
    assert len(row["traffic"]) == _call_kwargs("pixart")["num_inference_steps"], where
    assert not traffic_mismatches(row["traffic"], where), traffic_mismatches(row["traffic"], where)
    degrees = {g for g in ("ulysses", "ring", "pipefusion", "cfg", "dp") if getattr(config, g) > 1}
    assert degrees <= {g for step in row["traffic"] for g in step["moved"]}, where


TEXT_AT = dict(
    pixart="cross",
    sd3="last",
    flux="first",
    flux2="first",
    qwenimage="first",
    hunyuanvideo="last",
    cogvideox="first",
    wan="cross",
    zimage="last",
    sana="cross",
    hunyuanvideo15="last",
)


def _check_token_layout(family, summaries):
    """The summaries say where the family's text sits (diffusers' own forward, read from the
    adapter's attention kinds); the view draws each rank's image shard after the text when it comes
    first, and the text after the image (SD3) or apart (cross-attention) otherwise."""
    from xdit_lab.lab.layout_views import draw_token_layouts
    from xdit_lab.lab.views import legibility_problems

    assert {s["shapes"]["text_at"] for s in summaries} == {TEXT_AT[family]}, family
    image, text = summaries[0]["image_tokens"], summaries[0]["shapes"]["text_len"]
    assert text > 0 and sum(stop - start for s in summaries for start, stop in s["shard"]["tokens"]) == image
    fig = draw_token_layouts({family: summaries})
    bars = sorted(tuple(path.vertices[0][0] for path in c.get_paths()) for c in fig.axes[0].collections)
    starts = sorted(x for (x,) in bars)
    offset = text if TEXT_AT[family] == "first" else 0
    shards = sorted(offset + start for s in summaries for start, _ in s["shard"]["tokens"])
    text_start = {"first": 0, "last": image}.get(TEXT_AT[family])
    assert all(x in starts for x in shards), (family, starts, shards)
    if text_start is not None:
        assert text_start in starts, (family, starts)
    else:  # cross-attention: the text is drawn apart, after the image
        assert max(starts) > image, (family, starts)
    assert not legibility_problems(fig), legibility_problems(fig)


# HunyuanVideo-1.5's image to video: SigLIP's embeddings of the image lead the joint text, its latents and a frame-0
# mask go on the channels; it draws at the image's size bucket
def _hunyuan15_i2v_call():
    from PIL import Image

    pixels = torch.randint(0, 256, (64, 64, 3), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    return dict(
        num_inference_steps=3, num_frames=5, negative_prompt=list(NEGATIVES), image=Image.fromarray(pixels.numpy())
    )


def _hunyuan15_i2v_parallel(folder, configs, expected):
    """_parallel's rows, then the control's error: the image's latents dropped from the channels (text to video's
    zeros in their place), under the first configuration (every rank busy)."""
    rows = _parallel(folder, "hunyuanvideo15", configs, expected, _hunyuan15_i2v_call())
    config = configs[0]
    pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False)
    prepare = pipe.recipe.prepare

    def without_the_image(pipe, request, prepared, device):
        prepare(pipe, request, prepared, device)
        prepared.extra.pop("image_condition")

    pipe.recipe.prepare = without_the_image
    latents = output_latents(pipe(PROMPTS, seed=0, output_type="latent", **_hunyuan15_i2v_call()))
    return rows, (latents - expected).abs().max().item()


@pytest.mark.parametrize("world_size", [2, 4])
def test_hunyuanvideo15_image_to_video_equals_diffusers_pipeline(tmp_path, world_size):
    """HunyuanVideo15ImageToVideoPipeline (the tiny parts with a SigLIP vision tower) through load_pipeline under
    every strategy, PipeFusion with every step a warm-up step among them: equal to diffusers' pipeline from the same
    folder run serially (1e-4 relative), each step's bytes the closed form's, the plan (the image's bucket, SigLIP's
    tokens) what a rank holds. Control: the image's latents left off the channels misses the bound."""
    from diffusers import DiffusionPipeline

    folder = save_tiny_pipeline("hunyuanvideo15", tmp_path / "i2v", pipeline_class="HunyuanVideo15ImageToVideoPipeline")
    reference = DiffusionPipeline.from_pretrained(folder)
    assert type(reference).__name__ == "HunyuanVideo15ImageToVideoPipeline"
    reference.set_progress_bar_config(disable=True)
    generator = torch.Generator().manual_seed(0)
    expected = output_latents(
        reference(prompt=list(PROMPTS), generator=generator, output_type="latent", **_hunyuan15_i2v_call())
    )
    configs = CONFIGS[world_size]
    per_rank = run_on_ranks(_hunyuan15_i2v_parallel, world_size, folder, configs, expected, timeout_s=500)
    _check_rows([rows for rows, _ in per_rank], configs, "hunyuanvideo15 image to video")
    bound = 1e-4 * max(1.0, expected.abs().max().item())
    for rank, (_, control) in enumerate(per_rank):
        assert control > bound, f"rank {rank}: the video drawn without the image's latents within the bound"


def _hunyuan15_stale(folder, configs, expected):
    """_parallel's rows, then what load_pipeline says to the async schedule."""
    rows = _parallel(folder, "hunyuanvideo15", configs, expected)
    config = ParallelConfig(pipefusion=2, pipefusion_schedule="async")
    try:
        load_pipeline(folder, config, mesh=RankMesh(config), progress=False)
    except Exception as error:
        return rows, f"{type(error).__name__}: {error}"
    return rows, None


def test_hunyuanvideo15_pipefusion_patch_steps_measured_against_diffusers(tmp_path):
    """HunyuanVideo-1.5's PipeFusion past its warm-up (2 stages, 2 patches: stale K/V of the other patch from the step
    before), with no warm-up step of three and with one, against diffusers' pipeline run serially: off by more than the
    exact bound (stale; the control of the warm-up's exactness) and by less than 10% of the latents (measured 2.9e-3
    relative without warm-up), each step's bytes the closed form's, the stale K/V a stage kept as planned. The async
    schedule, which steps the scheduler on the model input's layout (the latents with the condition's channels), is
    refused by name with the schedule that runs."""
    folder = save_tiny_pipeline("hunyuanvideo15", tmp_path / "t2v")
    expected = _reference(folder, "hunyuanvideo15")
    configs = [ParallelConfig(pipefusion=2, warmup_steps=0), ParallelConfig(pipefusion=2, warmup_steps=1)]
    per_rank = run_on_ranks(_hunyuan15_stale, 2, folder, configs, expected, timeout_s=300)
    for rank, (rows, refused) in enumerate(per_rank):
        assert refused and refused.startswith(
            "ParallelConfigError: HunyuanVideo15Pipeline does not run under pipefusion_schedule='async': the transformer takes"
        ), refused
        assert "use the drained schedule (the default)" in refused
        for row, config in zip(rows, configs):
            where = f"hunyuanvideo15 {row['config']} warm-up {config.warmup_steps} rank {rank}"
            assert row["bound"] < row["error"] < 0.1 * expected.abs().max().item(), (where, row["error"])
            _check_traffic(row, config, where)
            assert row["planned"] == row["held"], f"{where}: planned {row['planned']}, held {row['held']}"


def _hunyuan15_meanflow_parallel(folder, configs, expected):
    """_parallel's rows, then the control's error: the MeanFlow model run without the next step's timestep."""
    rows = _parallel(folder, "hunyuanvideo15", configs, expected, _hunyuan15_i2v_call())
    pipe = load_pipeline(folder, configs[0], mesh=RankMesh(configs[0]), progress=False)
    model_kwargs = pipe.recipe.model_kwargs

    def without_timestep_r(*args):
        arguments = model_kwargs(*args)
        arguments.pop("timestep_r")
        return arguments

    pipe.recipe.model_kwargs = without_timestep_r
    latents = output_latents(pipe(PROMPTS, seed=0, output_type="latent", **_hunyuan15_i2v_call()))
    return rows, (latents - expected).abs().max().item()


def test_hunyuanvideo15_meanflow_image_to_video_equals_diffusers_pipeline(tmp_path):
    """A MeanFlow image-to-video model (use_meanflow: HunyuanVideo-1.5's step-distilled 480p) takes the next step's
    timestep beside this one (timestep_r, 0 after the last): under ulysses 2 and cfg 2 equal to diffusers'
    pipeline run serially. Control: left without timestep_r, it misses the bound."""
    from diffusers import DiffusionPipeline

    from xdit_lab.tiny import tiny_pipeline, tiny_transformer

    pipe = tiny_pipeline("hunyuanvideo15", pipeline_class="HunyuanVideo15ImageToVideoPipeline")
    pipe.register_modules(transformer=tiny_transformer("hunyuanvideo15", use_meanflow=True))
    pipe.save_pretrained(tmp_path / "meanflow")
    reference = DiffusionPipeline.from_pretrained(tmp_path / "meanflow")
    assert reference.transformer.config.use_meanflow
    reference.set_progress_bar_config(disable=True)
    generator = torch.Generator().manual_seed(0)
    expected = output_latents(
        reference(prompt=list(PROMPTS), generator=generator, output_type="latent", **_hunyuan15_i2v_call())
    )
    configs = [ParallelConfig(ulysses=2), ParallelConfig(cfg=2)]
    per_rank = run_on_ranks(_hunyuan15_meanflow_parallel, 2, tmp_path / "meanflow", configs, expected, timeout_s=400)
    _check_rows([rows for rows, _ in per_rank], configs, "hunyuanvideo15 MeanFlow image to video")
    bound = 1e-4 * max(1.0, expected.abs().max().item())
    assert all(control > bound for _, control in per_rank), [control for _, control in per_rank]


def _hunyuan15_videos(folder):
    """The decoded frames of one prompt and of two, under dp 2 (each rank decodes its own video)."""
    config = ParallelConfig(dp=2)
    pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False)
    call = dict(tiny_pipeline_kwargs("hunyuanvideo15"), num_inference_steps=2, output_type="np", seed=0)
    return pipe(PROMPTS[:1], **call).frames, pipe(PROMPTS, **call).frames


def test_hunyuanvideo15_decodes_each_video_as_diffusers_decodes_one(tmp_path):
    """diffusers 0.42.1's AutoencoderKLHunyuanVideo15 decodes one video a call (its mid-block attention's [B, S, S]
    mask does not broadcast over a batch of more): the recipe decodes video by video, so one prompt's frames equal
    diffusers' pipeline's, and two prompts decode (the first prompt's frames the same), where diffusers' raises."""
    import numpy as np
    from diffusers import DiffusionPipeline

    folder = save_tiny_pipeline("hunyuanvideo15", tmp_path / "t2v")
    reference = DiffusionPipeline.from_pretrained(folder)
    reference.set_progress_bar_config(disable=True)
    call = dict(tiny_pipeline_kwargs("hunyuanvideo15"), num_inference_steps=2, output_type="np")
    expected = reference(prompt=PROMPTS[:1], generator=torch.Generator().manual_seed(0), **call).frames
    with pytest.raises(RuntimeError, match="doesn't match the broadcast shape"):  # the control: diffusers' own
        reference(prompt=PROMPTS, generator=torch.Generator().manual_seed(0), **call)
    for one, two in run_on_ranks(_hunyuan15_videos, 2, folder, timeout_s=300):
        assert np.abs(one - expected).max() <= 1e-4 and two.shape == (2, *expected.shape[1:])
        assert np.abs(two[:1] - expected).max() <= 1e-4


def test_pixart_sigma_through_load_pipeline(tmp_path):
    """A PixArtSigmaPipeline folder (tiny, saved here) through load_pipeline under the exact
    strategies on 2 ranks, PipeFusion with every step a warmup step among them: equal to diffusers'
    PixArtSigmaPipeline run serially, within 1e-4 relative, each step's bytes as the closed form says.
    Control: PipeFusion without warmup (every step on stale K/V) exceeds the bound. (On this tiny
    random model one warmup step of three already lands within it, measured 7e-5 relative: the
    bound catches gross staleness here; tests/test_pipefusion.py bounds it on the digits model.)"""
    import json

    folder = save_tiny_pipeline("pixart", tmp_path / "pixart-sigma", pipeline_class="PixArtSigmaPipeline")
    assert json.loads((folder / "model_index.json").read_text())["_class_name"] == "PixArtSigmaPipeline"
    steps = _call_kwargs("pixart")["num_inference_steps"]
    configs = [
        ParallelConfig(ulysses=2),
        ParallelConfig(ring=2),
        ParallelConfig(cfg=2),
        ParallelConfig(pipefusion=2, warmup_steps=steps),
    ]
    control = ParallelConfig(pipefusion=2, warmup_steps=0)
    expected = _reference(folder, "pixart")
    for rank, rows in enumerate(
        run_on_ranks(_parallel, 2, folder, "pixart", [*configs, control], expected, timeout_s=300)
    ):
        assert [row["config"] for row in rows] == [config.short() for config in (*configs, control)]
        assert rows[-1]["error"] > rows[-1]["bound"], f"rank {rank}: stale K/V in every step within the bound"
        for row, config in zip(rows, configs):
            where = f"pixart-sigma {row['config']} rank {rank}"
            assert row["shape"] == row["expected_shape"], where
            assert row["error"] <= row["bound"], f"{where}: {row['error']:.3g} > {row['bound']:.3g}"
            _check_traffic(row, config, where)


def test_sana_pipefusion_patch_steps_measured_against_diffusers(folders, references):
    """Sana's PipeFusion past its warm-up (one warm-up step of three, 2 stages, 2 patches), drained and async: its
    patch steps attend with the other patch's kept linear-attention sums and convolve with its kept edge rows,
    measured against diffusers' SanaPipeline run serially: off by more than the exact bound (stale) and by less
    than 10% of the latents; the async schedule equal to the drained one (an elementwise scheduler stepped patch
    by patch reads the same kept values), each step's bytes as the closed form says, and what a stage kept
    between steps as planned."""
    configs = [
        ParallelConfig(pipefusion=2, warmup_steps=1),
        ParallelConfig(pipefusion=2, warmup_steps=1, pipefusion_schedule="async"),
    ]
    expected = references["sana"]
    per_rank = run_on_ranks(_parallel, 2, folders["sana"], "sana", configs, expected, timeout_s=300)
    for rank, rows in enumerate(per_rank):
        drained, pipelined = rows
        for row, config in zip(rows, configs):
            where = f"sana {row['config']} rank {rank}"
            assert row["bound"] < row["error"] < 0.1 * expected.abs().max().item(), (where, row["error"])
            _check_traffic(row, config, where)
            assert row["planned"] == row["held"], f"{where}: planned {row['planned']}, held {row['held']}"
        assert abs(pipelined["error"] - drained["error"]) <= drained["bound"], (drained["error"], pipelined["error"])


def _sana_rows_refused(folder):
    """A Sana call of 9 token rows (36 pixels) on 2 sequence shards: refused at the request, before any encode."""
    pipe = load_pipeline(folder, ParallelConfig(ulysses=2), mesh=RankMesh(ParallelConfig(ulysses=2)), progress=False)
    try:
        pipe.session(PROMPTS, seed=0, **dict(_call_kwargs("sana"), height=36))
    except ValueError as error:
        return str(error)


def test_sana_height_that_shards_cannot_hold_as_whole_rows_is_refused_at_the_request(folders):
    for message in run_on_ranks(_sana_rows_refused, 2, folders["sana"], timeout_s=180):
        assert message and "9 token rows, which 2 sequence shards" in message, message
        assert "a multiple of 8 pixels" in message, message


def _digits_in_bfloat16(configs, steps):
    """The ten digits (seed 0 each) drawn by diffusers' PixArtAlphaPipeline run serially in float32
    and in bfloat16, then by load_pipeline in bfloat16 under each configuration (rank 0's latents)."""
    from diffusers import PixArtAlphaPipeline

    from xdit_lab.digits import DIGITS_DIR, call_kwargs, prompt_for

    prompts = [prompt_for(digit) for digit in range(10)]
    kwargs = call_kwargs(num_inference_steps=steps)

    def generators():
        return [torch.Generator().manual_seed(0) for _ in prompts]

    serial = {}
    for dtype in (torch.float32, torch.bfloat16):
        reference = PixArtAlphaPipeline.from_pretrained(str(DIGITS_DIR), torch_dtype=dtype)
        reference.set_progress_bar_config(disable=True)
        serial[str(dtype)] = reference(prompts, generator=generators(), output_type="latent", **kwargs).images
    parallel, traffic = {}, {}
    for config in configs:
        name = f"{config.short()} warmup {config.warmup_steps}"
        pipe = load_pipeline("digits", config, mesh=RankMesh(config), torch_dtype=torch.bfloat16, progress=False)
        session = pipe.session(prompts, generator=generators(), **kwargs).run()
        parallel[name] = session.result(output_type="latent").images
        traffic[name] = session_traffic(session)  # bfloat16 activations: 2 bytes an element
    return serial, parallel, traffic


def test_bfloat16_strategies_within_bfloat16_rounding():
    """In bfloat16 an exact strategy need not match serial bit for bit (Ring merges its blocks'
    partial results in float32, so it rounds differently), so its tolerance is bf16's own rounding
    on this very computation: d = how far diffusers' serial bf16 run is from its float32 run
    (measured here; 2.2e-2 max relative on the bundled model, 10 digits, 10 steps). An exact
    strategy in bf16 stays within d of diffusers' serial bf16 run (measured: Ring 1.1e-2, Ulysses
    and PipeFusion with every step a warmup step bit-identical). Control: PipeFusion with stale
    K/V (warmup 1), not exact by design, exceeds d (measured 7.9e-2). Each step's bytes equal the closed
    form at 2 bytes an element."""
    from xdit_lab.lab.measure import max_relative_difference

    steps = 10
    exact = [ParallelConfig(ring=2), ParallelConfig(ulysses=2), ParallelConfig(pipefusion=2, warmup_steps=steps)]
    stale = ParallelConfig(pipefusion=2, warmup_steps=1)
    ranks = run_on_ranks(_digits_in_bfloat16, 2, [*exact, stale], steps, timeout_s=300)
    serial, parallel, _ = ranks[0]
    for rank, (_, _, traffic) in enumerate(ranks):
        for name, steps_traffic in traffic.items():
            assert len(steps_traffic) == steps and not traffic_mismatches(steps_traffic, f"{name} rank {rank}")
    reference = serial[str(torch.bfloat16)]
    tolerance = max_relative_difference(reference, serial[str(torch.float32)])
    assert reference.dtype == torch.bfloat16 and 1e-3 < tolerance < 0.1  # bf16 keeps ~3 significant digits
    for config in exact:
        latents = parallel[f"{config.short()} warmup {config.warmup_steps}"]
        assert latents.dtype == torch.bfloat16
        assert max_relative_difference(latents, reference) <= tolerance, config.short()
    assert max_relative_difference(parallel[f"{stale.short()} warmup 1"], reference) > tolerance


def _one_branch_refusals(folders):
    """What a call with one branch meets under cfg 2, and a negative prompt on a family without one."""
    from xdit_lab.config import ParallelConfigError

    refused = {}
    try:
        load_pipeline(folders["flux2"], ParallelConfig(cfg=2), progress=False)
    except ParallelConfigError as error:
        refused["flux2 cfg 2"] = str(error)
    flux2 = load_pipeline(folders["flux2"], ParallelConfig(dp=2), progress=False)
    try:
        flux2.session(PROMPTS, negative_prompt=NEGATIVES, seed=0, **_call_kwargs("flux2"))
    except ValueError as error:
        refused["flux2 negatives"] = str(error)
    flux2.close()
    pixart = load_pipeline(folders["pixart"], ParallelConfig(cfg=2), progress=False)
    try:
        pixart.session(PROMPTS, seed=0, **dict(_call_kwargs("pixart"), guidance_scale=1.0))
    except ValueError as error:
        refused["pixart guidance 1"] = str(error)
    return refused


def test_a_call_with_one_branch_is_refused_under_cfg_2_by_name(folders):
    """Flux.2 is guidance-distilled: its pipeline has no unconditional branch and no negative prompt,
    so cfg 2 is refused at load and a negative prompt at the call. Under cfg 2, a PixArt call at
    guidance 1 (one branch) is refused with what would give it two, where it used to split the prompts
    as if they were the branches."""
    for refused in run_on_ranks(_one_branch_refusals, 2, folders, timeout_s=120):
        assert "flux2's pipeline has one branch" in refused["flux2 cfg 2"] and "dp 2" in refused["flux2 cfg 2"]
        assert "takes no negative_prompt" in refused["flux2 negatives"]
        assert "a guidance_scale above 1, or load with cfg 1" in refused["pixart guidance 1"]


def test_the_load_plan_counts_the_rows_the_recipe_runs():
    """The load's plan sizes PipeFusion's stale K/V at the rows of one prompt at the call defaults, as
    the recipe decides them (a negative prompt counted as given). It used to read guidance_scale > 1,
    which counted Flux's distilled 3.5 as two branches and Qwen-Image's None as one."""
    from xdit_lab.families import recipe_for
    from xdit_lab.plan.terms import kv_rows, load_branches

    def rows(pipeline, config, index=None, **defaults):  # one prompt's rows on the busiest rank
        recipe = recipe_for(pipeline, index)
        return kv_rows(config, load_branches(recipe, {**recipe.defaults, **defaults}))

    one = ParallelConfig()
    assert rows("PixArtAlphaPipeline", one) == 2 and rows("PixArtAlphaPipeline", ParallelConfig(cfg=2)) == 1
    assert rows("PixArtAlphaPipeline", one, guidance_scale=1.0) == 1
    assert rows("FluxPipeline", one) == 1 and rows("FluxPipeline", one, true_cfg_scale=2.0) == 2
    assert rows("QwenImagePipeline", one) == 2  # true_cfg_scale 4.0 by default
    assert rows("Flux2Pipeline", one) == 1 and rows("PixArtAlphaPipeline", ParallelConfig(dp=2)) == 1
    # Flux.2 klein: its folder's is_distilled says (diffusers' default, the base model's true CFG, without it)
    assert rows("Flux2KleinPipeline", one) == 2 and rows("Flux2KleinPipeline", one, {"is_distilled": False}) == 2
    assert rows("Flux2KleinPipeline", one, {"is_distilled": True}) == 1
    assert rows("Flux2KleinPipeline", one, guidance_scale=1.0) == 1


def _zimage_stale(folder, expected, kwargs):
    """Z-Image's PipeFusion past its warm-up, drained and async; and the drained one on zeros for stale K/V."""
    from xdit_lab.lessons.controls import wrong_stale_kv

    rows = _parallel(folder, "zimage", ZIMAGE_STALE, expected, dict(kwargs))
    control = _parallel(folder, "zimage", ZIMAGE_STALE[:1], expected, dict(kwargs), wrong_stale_kv("zeros"))
    return rows, control[0]


ZIMAGE_STALE = [
    ParallelConfig(pipefusion=2, warmup_steps=1),
    ParallelConfig(pipefusion=2, warmup_steps=1, pipefusion_schedule="async"),
]
# Z-Image's stale PipeFusion (one warm-up step of 8, 2 patches) from diffusers' serial ZImagePipeline, max abs
# error over max |reference|: 1.25 × the 3.7e-2 measured here (torch 2.13 CPU, deterministic). Zeros for the stale
# K/V measure 1.1e-1; a patch reading its own K/V of the step before 4.6e-2, at the bound: not a control here. The
# tiny random model moves far between its few steps: with 3 steps the stale run (1.5e-1) is no closer than zeros
# (1.3e-1), hence 8.
ZIMAGE_STALE_BOUND = 1.25 * 3.7e-2


def test_zimage_pipefusion_patch_steps_measured_against_diffusers(folders):
    """Z-Image's PipeFusion past its warm-up (2 stages, 2 patches, the image's padding tokens in the last), drained
    and async, measured against diffusers' ZImagePipeline run serially: off by more than the exact bound (stale)
    and within ZIMAGE_STALE_BOUND, the async schedule equal to the drained one, each step's bytes as the closed
    form says, and what a stage kept between steps as planned. Control: zeros for the stale K/V exceed the bound."""

    def call():  # fresh lists: ZImagePipeline writes its chat template into those it is given
        return dict(_family_kwargs("zimage"), num_inference_steps=8)

    expected = _reference(folders["zimage"], "zimage", call())
    scale = expected.abs().max().item()
    for rank, (rows, control) in enumerate(
        run_on_ranks(_zimage_stale, 2, folders["zimage"], expected, call(), timeout_s=300)
    ):
        drained, pipelined = rows
        for row in rows:
            where = f"zimage {row['config']} rank {rank}"
            assert row["bound"] < row["error"] <= ZIMAGE_STALE_BOUND * scale, (where, row["error"] / scale)
            assert len(row["traffic"]) == 8 and not traffic_mismatches(row["traffic"], where), row["traffic"]
            assert row["planned"] == row["held"], f"{where}: planned {row['planned']}, held {row['held']}"
        assert abs(pipelined["error"] - drained["error"]) <= drained["bound"], (drained["error"], pipelined["error"])
        assert control["error"] > ZIMAGE_STALE_BOUND * scale, (rank, control["error"] / scale)


ZIMAGE_BESIDE = [  # every step a warm-up step: exact
    ParallelConfig(pipefusion=2, cfg=2, warmup_steps=3),
    ParallelConfig(pipefusion=2, dp=2, warmup_steps=3),
]


def test_zimage_pipefusion_beside_cfg_and_dp_on_four_ranks(folders, references):
    """ZImagePipeline with its stages beside cfg 2 (each branch's two stages) and dp 2 (each prompt's): equal to
    diffusers' own pipeline run serially, each step's bytes the closed form's, the plan what a rank holds."""
    per_rank = run_on_ranks(
        _parallel, 4, folders["zimage"], "zimage", ZIMAGE_BESIDE, references["zimage"], timeout_s=300
    )
    _check_rows(per_rank, ZIMAGE_BESIDE, "zimage")


ZIMAGE_GUIDANCE = {  # ZImagePipeline's guidance options, each under the configuration that runs it
    "cfg_normalization": (ParallelConfig(cfg=2), dict(cfg_normalization=1.0)),  # no longer than the positive's norm
    "cfg_truncation": (ParallelConfig(cfg=2), dict(cfg_truncation=0.2)),  # the last of 3 steps unguided (t_norm 0.4)
    "guidance 0": (ParallelConfig(ulysses=2), dict(guidance_scale=0.0)),  # Z-Image-Turbo's: one branch
}


def _zimage_guided(folder):
    latents = {}
    for name, (config, options) in ZIMAGE_GUIDANCE.items():
        pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False)
        call = dict(_family_kwargs("zimage"), **options)
        latents[name] = output_latents(pipe(PROMPTS, seed=0, output_type="latent", **call))
    return latents


def test_zimage_guidance_options_equal_diffusers(tmp_path):
    """ZImagePipeline's own guidance, beside its plain CFG (test_latents_equal_diffusers_pipeline): the prediction
    rescaled to the positive's norm (cfg_normalization), guidance dropped at the steps past cfg_truncation, and none
    at all (guidance 0, Z-Image-Turbo's), each equal to diffusers' pipeline on the same folder and each moving the
    result away from the plain call's (the option is not ignored)."""
    from diffusers import DiffusionPipeline

    folder = save_tiny_pipeline("zimage", tmp_path / "zimage")
    reference = DiffusionPipeline.from_pretrained(folder)
    reference.set_progress_bar_config(disable=True)

    def serial(**options):
        generator = torch.Generator().manual_seed(0)
        call = dict(_family_kwargs("zimage"), **options)
        # a copy: ZImagePipeline writes each prompt's chat template into the list it is given
        return output_latents(reference(prompt=list(PROMPTS), generator=generator, output_type="latent", **call))

    plain, expected = serial(), {name: serial(**options) for name, (_, options) in ZIMAGE_GUIDANCE.items()}
    for rank, latents in enumerate(run_on_ranks(_zimage_guided, 2, folder, timeout_s=300)):
        for name, target in expected.items():
            bound = 1e-4 * max(1.0, target.abs().max().item())
            assert (latents[name] - target).abs().max().item() <= bound, f"zimage {name} rank {rank}"
            assert (target - plain).abs().max().item() > 10 * bound, f"zimage {name}: the option changed nothing"
