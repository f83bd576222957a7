"""Arguments with one entry per image token follow the tokens' shard (families/adapter.py PerToken), against
diffusers' serial forward:

    Wan 2.2 TI2V     timestep [B, S], one per token, at the forward       ulysses, ring, usp, pipefusion, cfg
    Qwen-Image-Edit  modulate_index [B, S] (zero_cond_t), at every block   ulysses, ring, usp, cfg (img_shapes split)
    HunyuanVideo I2V num_tokens (token_replace), the frame-0 count         ulysses, ring, usp, pipefusion, cfg

Each case's per-token values differ from token to token (random timesteps; a target image and a reference;
a first frame and a second), so a rank that took another rank's entries would compute something else. The
control runs that wrong variant on a fresh model: the strategy keeps the mirrored entries (a tensor) or the
whole count (the frame-0 count uncut), and its error must exceed the bound. (Under PipeFusion alone a rank
holds every token in the exact, warmup, step: the uncut count is then the right one, and the count is
checked where ranks split the patches, pf2·ring2.) Every degree above 1 moves exactly its closed
form (tests/forward_traffic.py).
"""

import pytest
import torch
from forward_traffic import session_traffic, traffic_mismatches, traffic_row

from xdit_lab import ParallelConfig, RankMesh, comm_log, load_pipeline, parallelize
from xdit_lab.lessons.families import output_latents
from xdit_lab.models import parallel_state
from xdit_lab.testing import run_on_ranks
from xdit_lab.tiny import tiny_inputs, tiny_pipeline, tiny_pipeline_kwargs, tiny_transformer

CASES = {  # family -> the configs it runs under, on 2 and on 4 ranks
    "wan": {
        2: [ParallelConfig(ulysses=2), ParallelConfig(ring=2), ParallelConfig(pipefusion=2), ParallelConfig(cfg=2)],
        4: [ParallelConfig(ulysses=2, ring=2), ParallelConfig(pipefusion=2, ulysses=2)],
    },
    # several images per sample are refused under PipeFusion (tests/test_models.py): sp, cfg and dp
    "qwenimage": {
        2: [ParallelConfig(ulysses=2), ParallelConfig(ring=2), ParallelConfig(cfg=2)],
        4: [ParallelConfig(ulysses=2, ring=2), ParallelConfig(dp=2, ulysses=2)],
    },
    "hunyuanvideo": {
        2: [ParallelConfig(ulysses=2), ParallelConfig(ring=2), ParallelConfig(pipefusion=2), ParallelConfig(dp=2)],
        4: [ParallelConfig(ulysses=2, ring=2), ParallelConfig(pipefusion=2, ring=2)],
    },
}
TOKENS = {"qwenimage": (16, 4)}  # a target image of 4 × 4 tokens and a reference of 2 × 2


def _case(family):
    """The tiny model with its per-token conditioning on, and inputs whose per-token values vary."""
    g = torch.Generator().manual_seed(5)
    if family == "wan":  # 2 latent frames of 4 × 4 tokens: a timestep each, as Wan 2.2 TI2V's pipeline gives
        inputs = tiny_inputs("wan", 2)
        return tiny_transformer("wan", seed=0), inputs | {"timestep": torch.rand(2, 32, generator=g) * 1000}
    if family == "qwenimage":  # zero_cond_t: the reference's tokens are modulated at t = 0
        target, reference = TOKENS["qwenimage"]
        inputs = tiny_inputs("qwenimage", 2) | {
            "hidden_states": torch.randn(2, target + reference, 16, generator=g),
            "img_shapes": [[(1, 4, 4), (1, 2, 2)]] * 2,
        }
        return tiny_transformer("qwenimage", seed=0, zero_cond_t=True), inputs
    # token replace: the first of 2 frames (16 of 32 tokens) modulated at t = 0
    return tiny_transformer("hunyuanvideo", seed=0, image_condition_type="token_replace"), tiny_inputs(
        "hunyuanvideo", 2
    )


def _traffic_inputs(family, inputs):
    """The inputs the closed form reads its token count from: an edit's two images as one row of tokens
    (the closed form counts tokens; token_grid refuses several images, which only PipeFusion would cut)."""
    if family != "qwenimage":
        return inputs
    return inputs | {"img_shapes": [[(1, 1, sum(TOKENS["qwenimage"]))]] * 2}


def _wrong(strategy):
    """The control: the strategy keeps other tokens' entries (mirrored) and leaves a frame-0 count uncut."""
    keep_tokens = strategy.keep_tokens
    strategy.keep_tokens = lambda tensor, dim: keep_tokens(tensor.flip(dim), dim)
    strategy.keep_prefix = lambda count: count


def _compare(cases):
    rows = []
    for family, config in cases:
        model, inputs = _case(family)
        with torch.no_grad():
            reference = model(**inputs).sample
        mesh = RankMesh(config)
        model = parallelize(model, config, mesh)
        with torch.no_grad(), comm_log() as log:
            output = model(**inputs).sample
        traffic = traffic_row(model, _traffic_inputs(family, inputs), log, step=0)
        control = None
        if config.sp_degree > 1 or (config.pipefusion > 1 and family != "hunyuanvideo"):
            wrong = parallelize(_case(family)[0], config, mesh)
            _wrong(parallel_state(wrong).strategy)
            with torch.no_grad():
                control = (wrong(**inputs).sample - reference).abs().max().item()
        rows.append(
            dict(
                where=f"{family} {config.short()}",
                error=(output - reference).abs().max().item(),
                bound=1e-4 * max(1.0, reference.abs().max().item()),
                control=control,
                **traffic,
            )
        )
    return rows


@pytest.mark.parametrize("world_size", [2, 4])
def test_per_token_arguments_follow_the_shard_exactly(world_size):
    cases = [(family, config) for family, configs in CASES.items() for config in configs[world_size]]
    for rank, rows in enumerate(run_on_ranks(_compare, world_size, cases, timeout_s=300)):
        assert len(rows) == len(cases)
        for row in rows:
            where = f"{row['where']} rank {rank}"
            assert row["error"] <= row["bound"], f"{where}: error {row['error']:.3g} > {row['bound']:.3g}"
            assert row["moved"] == row["expected"], f"{where}: moved {row['moved']}, closed form {row['expected']}"
            assert row["moved"], where  # every degree above 1 moved something
            if row["control"] is not None:
                assert row["control"] > 10 * row["bound"], f"{where}: the wrong entries give {row['control']:.3g}"


# ---- Wan 2.2 TI2V 5B's pipelines: text to video (WanPipeline) and image to video (WanImageToVideoPipeline) ----
PROMPTS = ["a red cat", "a blue dog"]
WAN_CONFIGS = [
    ParallelConfig(ulysses=2),
    ParallelConfig(ring=2),
    ParallelConfig(cfg=2),
    ParallelConfig(pipefusion=2, warmup_steps=3),  # every step a warmup step: exact
]


def _first_frame():
    """The image image-to-video starts from: 64 × 64 random pixels."""
    from PIL import Image

    pixels = torch.randint(0, 256, (64, 64, 3), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def _wan_call(task):
    call = dict(tiny_pipeline_kwargs("wan"), num_inference_steps=3, negative_prompt=["", "a photo"])
    return call | {"image": _first_frame()} if task == "image to video" else call


def _wan_folders(root) -> dict:
    """Wan's tiny pipeline with expand_timesteps, as Wan 2.2 TI2V 5B's folder sets it, once as WanPipeline and
    once as WanImageToVideoPipeline (no CLIP image encoder: TI2V's transformer takes no image embeddings)."""
    from diffusers import WanImageToVideoPipeline

    text_to_video = tiny_pipeline("wan")
    text_to_video.register_to_config(expand_timesteps=True)
    parts = {k: v for k, v in text_to_video.components.items() if k != "transformer_2"}
    image_to_video = WanImageToVideoPipeline(**parts, image_encoder=None, image_processor=None, expand_timesteps=True)
    folders = {"text to video": root / "t2v", "image to video": root / "i2v"}
    text_to_video.save_pretrained(folders["text to video"], safe_serialization=True)
    image_to_video.save_pretrained(folders["image to video"], safe_serialization=True)
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
            session = pipe.session(PROMPTS, seed=0, **_wan_call(task)).run()
            latents = output_latents(session.result(output_type="latent"))
            rows.append(dict(task=task, config=config.short(), latents=latents, traffic=session_traffic(session)))
    config = configs[0]
    pipe = load_pipeline(folders["image to video"], config, mesh=RankMesh(config), progress=False)
    _uniform_timestep(pipe.recipe)
    control = output_latents(pipe(PROMPTS, seed=0, output_type="latent", **_wan_call("image to video")))
    return rows, control


def test_wan_2_2_ti2v_text_and_image_to_video_equal_diffusers(tmp_path):
    """Wan pipelines with expand_timesteps (Wan 2.2 TI2V 5B: a timestep per token) under ulysses, ring, cfg and
    PipeFusion, against diffusers' WanPipeline and WanImageToVideoPipeline from the same folders, run serially.
    Image to video holds the first frame's tokens at timestep 0, the others at t; the control gives every
    token t and must miss the reference. (Tokens with different timesteps and a strategy taking another rank's
    are test_per_token_arguments_follow_the_shard_exactly's Wan case.)"""
    from diffusers import DiffusionPipeline

    folders = _wan_folders(tmp_path)
    expected = {}
    for task, folder in folders.items():
        reference = DiffusionPipeline.from_pretrained(folder)
        assert reference.config.expand_timesteps and type(reference).__name__ in (
            "WanPipeline",
            "WanImageToVideoPipeline",
        )
        reference.set_progress_bar_config(disable=True)
        generator = torch.Generator().manual_seed(0)
        call = _wan_call(task)
        expected[task] = output_latents(reference(prompt=PROMPTS, generator=generator, output_type="latent", **call))
    for rank, (rows, control) in enumerate(run_on_ranks(_wan_parallel, 2, folders, WAN_CONFIGS, timeout_s=400)):
        assert len(rows) == 2 * len(WAN_CONFIGS)
        for row in rows:
            where, target = f"{row['task']} {row['config']} rank {rank}", expected[row["task"]]
            bound = 1e-4 * max(1.0, target.abs().max().item())
            assert (row["latents"] - target).abs().max().item() <= bound, where
            assert not traffic_mismatches(row["traffic"], where), traffic_mismatches(row["traffic"], where)
            assert all(step["moved"] for step in row["traffic"]), where
        image_to_video = expected["image to video"]
        assert (control - image_to_video).abs().max().item() > 10 * 1e-4 * max(1.0, image_to_video.abs().max().item())


def test_an_image_is_asked_for_where_it_is_taken_and_wan_2_1_image_to_video_is_refused(tmp_path):
    """Image to video without image=, text to video given one: each refused by name before anything runs; Wan
    2.1's image to video (no expand_timesteps: CLIP image embeddings and a mask on the channels) refused at load."""
    from diffusers import WanImageToVideoPipeline

    folders = _wan_folders(tmp_path)
    image_to_video = load_pipeline(folders["image to video"], progress=False)
    with pytest.raises(ValueError, match=r"WanImageToVideoPipeline draws a video from an image: give image="):
        image_to_video.session(PROMPTS, **_wan_call("text to video"))
    text_to_video = load_pipeline(folders["text to video"], progress=False)
    with pytest.raises(ValueError, match=r"WanPipeline draws from text alone and takes no image; image to video is"):
        text_to_video.session(PROMPTS, **_wan_call("image to video"))
    wan_2_1 = WanImageToVideoPipeline.from_pretrained(folders["image to video"], expand_timesteps=False)
    wan_2_1.save_pretrained(tmp_path / "wan21_i2v", safe_serialization=True)
    with pytest.raises(NotImplementedError, match=r"Wan 2.1's image-to-video pipeline .* not run by xdit_lab yet"):
        load_pipeline(tmp_path / "wan21_i2v", progress=False)
