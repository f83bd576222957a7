"""Specimens: tiny diffusers models and pipelines with random weights, for tests, benchmarks and tutorials.

Nothing here is runtime: these are the fixtures every strategy is checked on. Each family's file
(xdit_lab/families/<family>.py) says what its specimen is made of (`TINY`, a table: tiny_spec.py); this
package builds it, the same way for every family:

    tiny_transformer(family)             the family's diffusers transformer, HEADS × HEAD_DIM, two layers,
                                         seeded (every rank builds the same weights); milliseconds a forward
    tiny_inputs(family, batch)           its forward's keyword arguments
    tiny_pipeline(family)                a whole stock diffusers pipeline around it: text encoders, local
                                         tokenizers, VAE, scheduler (tokenizers.py, encoders.py, vaes.py), each part seeded
    save_tiny_pipeline(family, path)     that pipeline saved as an ordinary diffusers folder
    tiny_pipeline_kwargs(family)         call arguments that run it in well under a second on a CPU
    tiny_wan_2_1_image_to_video()        other layouts of a family's pipeline, built from its tiny parts
    tiny_qwen_image_edit(plus=...)
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import torch

from ..families import MODULES
from ..families import family as family_module
from ..families.tiny_spec import HEAD_DIM, HEADS, INNER, MAX_TOKENS, TEXT_DIM, Part
from . import encoders, tokenizers, vaes


def _builder(name: str):
    """The tiny part builder a family's TINY names (families/tiny_spec.Part), from this package's three kinds of
    part, or None (then a diffusers class: a scheduler)."""
    return next((getattr(kind, name) for kind in (tokenizers, encoders, vaes) if hasattr(kind, name)), None)


# family -> the diffusers pipeline its tiny parts make by default (families without a pipeline left out)
PIPELINES = {name: module.TINY.pipeline_classes[0] for name, module in MODULES.items() if module.TINY.pipeline_classes}

__all__ = [
    "HEADS",
    "HEAD_DIM",
    "MAX_TOKENS",
    "PIPELINES",
    "TEXT_DIM",
    "save_tiny_pipeline",
    "tiny_inputs",
    "tiny_pipeline",
    "tiny_pipeline_kwargs",
    "tiny_qwen_image_edit",
    "tiny_transformer",
]


def _spec(family: str):
    if family not in MODULES:
        raise ValueError(f"unknown tiny family {family!r}; choose one of {', '.join(MODULES)}")
    return family_module(family).TINY


def tiny_transformer(family: str, *, seed: int = 0, layers: int = 2, heads: int | None = None, **overrides):
    """The family's diffusers transformer at its tiny size (TINY.transformer), with random weights from `seed`,
    `heads` attention heads (the family's TINY.heads where None)."""
    import diffusers

    spec = _spec(family)
    heads = spec.heads if heads is None else heads
    torch.manual_seed(seed)
    shared = dict(num_attention_heads=heads, attention_head_dim=HEAD_DIM, num_layers=layers)
    settings = {name: value for key, value in shared.items() for name in spec.size_names.get(key, (key,))}
    settings |= {key: heads * HEAD_DIM if value == INNER else value for key, value in spec.transformer.items()}
    cls = getattr(diffusers, family_module(family).ADAPTER.class_name)
    return cls(**(settings | overrides)).eval()


def tiny_inputs(family: str, batch: int = 2, *, height: int = 8, width: int = 8, text_len: int = 6, seed: int = 1):
    """Forward kwargs for `tiny_transformer(family)`: a latent of height × width (in latent pixels), random
    text [batch, text_len, TEXT_DIM] and timesteps in [0, 1000), each family's own arguments beside them."""
    spec = _spec(family)
    g = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    text = randn(batch, text_len, TEXT_DIM)
    timestep = torch.rand(batch, generator=g) * 1000
    return spec.inputs(batch, height, width, text, timestep, randn)


def _build(part: Part, family: str, seed: int, built: dict):
    """One part: a tokenizer, a seeded text encoder or VAE, a scheduler (a diffusers class), the transformer."""
    import diffusers

    if part.builder == "transformer":
        return tiny_transformer(family, seed=seed, **part.kwargs)
    builder = _builder(part.builder) or getattr(diffusers, part.builder)
    args = [] if part.seed is None else [seed + part.seed]
    if part.vocab_of is not None:
        args.append(len(built[part.vocab_of]))
    return builder(*args, **part.kwargs)


def tiny_pipeline(family: str, *, seed: int = 0, pipeline_class: str | None = None, **settings):
    """A stock diffusers pipeline of `family` with tiny random parts, each seeded from `seed`;
    `pipeline_class` picks another of the family's pipelines (pixart: "PixArtSigmaPipeline"); `settings`: the
    pipeline's own (Flux2KleinPipeline's is_distilled), which a saved folder keeps in its model_index.json."""
    import diffusers

    spec = _spec(family)
    if not spec.pipeline_classes:
        raise ValueError(f"{family} has no tiny pipeline; families with one: {', '.join(PIPELINES)}")
    pipeline_class = pipeline_class or spec.pipeline_classes[0]
    if pipeline_class not in spec.pipeline_classes:
        raise ValueError(f"{family}'s tiny parts make {', '.join(spec.pipeline_classes)}, not {pipeline_class}")
    parts, built = spec.parts_of(pipeline_class), {}
    with torch.random.fork_rng():  # leave the caller's global RNG alone
        # tokenizers first: a text encoder takes its tokenizer's vocabulary size
        for name, part in sorted(parts.items(), key=lambda item: item[1].vocab_of is not None):
            built[name] = _build(part, family, seed, built)
    return getattr(diffusers, pipeline_class)(**built, **settings)


def tiny_wan_2_1_image_to_video(*, seed: int = 0):
    """Wan 2.1 I2V's layout at tiny size, a WanImageToVideoPipeline: the tiny Wan parts (one transformer), a
    transformer taking the noise, the image's mask and latents on its channels and CLIP image embeddings
    (image_dim, with the image's own key and value projections, as wide as the attention), and a CLIP vision
    tower as `image_encoder`: the one folder layout with an image encoder beside the text encoder."""
    from diffusers import WanImageToVideoPipeline

    wan = tiny_pipeline("wan", seed=seed)
    parts = {name: part for name, part in wan.components.items() if name != "transformer_2"}
    vision = encoders.clip_vision_encoder(5)
    z, temporal = wan.vae.config.z_dim, wan.vae_scale_factor_temporal
    transformer = tiny_transformer(
        "wan", seed=seed, in_channels=2 * z + temporal, out_channels=z, image_dim=vision.config.hidden_size,
        added_kv_proj_dim=HEADS * HEAD_DIM,
    )  # fmt: skip
    return WanImageToVideoPipeline(
        **(parts | {"transformer": transformer}),
        image_encoder=vision,
        image_processor=tokenizers.clip_image_processor(),
    )


def tiny_qwen_image_edit(*, plus: bool = False, zero_cond_t: bool = False, seed: int = 0):
    """Qwen-Image-Edit's layout at tiny size: QwenImageEditPipeline (one image), or with `plus`
    QwenImageEditPlusPipeline (Qwen-Image-Edit-2509's, several images), whose transformer with `zero_cond_t`
    (Qwen-Image-Edit-2511's) modulates the reference images' tokens at t = 0. The tiny Qwen-Image parts, but a
    transformer of 3 heads (an uneven count: Ulysses 2 splits them 2 + 1), a Qwen2.5-VL that sees the image (its
    vision tokens in the tokenizer, tokenizers.qwen_vl_processor) and a VAE of 32x (the pipelines encode the reference
    at 1024² pixels: vaes.qwen_edit_vae)."""
    import diffusers

    qwen = tiny_pipeline("qwenimage", seed=seed)
    processor = tokenizers.qwen_vl_processor()
    transformer = tiny_transformer("qwenimage", seed=seed, heads=3, zero_cond_t=zero_cond_t)
    pipeline = diffusers.QwenImageEditPlusPipeline if plus else diffusers.QwenImageEditPipeline
    return pipeline(
        scheduler=qwen.scheduler,
        vae=vaes.qwen_edit_vae(seed + 2, qwen.vae.config.z_dim),
        text_encoder=encoders.qwen_vl_encoder(seed + 1, len(processor.tokenizer), vision=True),
        tokenizer=processor.tokenizer,
        processor=processor,
        transformer=transformer,
    )


def save_tiny_pipeline(family: str, path, *, seed: int = 0, pipeline_class: str | None = None, **settings) -> Path:
    """Build `tiny_pipeline(family, ...)` and save it as a diffusers folder (model_index.json + safetensors); a video
    pipeline's folder with its tiny size as its call defaults (call_defaults.json: height and width). A model's
    defaults belong to its folder: a video pipeline's own default size is the real model's (HunyuanVideo's 720 × 1280
    × 129 frames), whose decode a tiny VAE would need gigabytes for, so a load planning one prompt at it would refuse
    what the tiny calls fit. An image pipeline's default size comes from its transformer's sample size: tiny already,
    and an image drawn from reference images takes their size, which a default would override."""
    path = Path(path)
    pipe = tiny_pipeline(family, seed=seed, pipeline_class=pipeline_class, **settings)
    pipe.save_pretrained(path, safe_serialization=True)
    takes = inspect.signature(type(pipe).__call__).parameters  # an image to video at its image's bucket takes none
    size = {key: value for key, value in _spec(family).call.items() if key in ("height", "width") and key in takes}
    if size and "num_frames" in takes:
        (path / "call_defaults.json").write_text(json.dumps(size, indent=2) + "\n")  # model_folder.CALL_DEFAULTS
    return path


def tiny_pipeline_kwargs(family: str) -> dict:
    """Call arguments that run the family's tiny pipeline in well under a second (TINY.call)."""
    spec = _spec(family)
    if not spec.pipeline_classes:
        raise ValueError(f"{family} has no tiny pipeline; families with one: {', '.join(PIPELINES)}")
    return {key: _builder(value.builder)() if isinstance(value, Part) else value for key, value in spec.call.items()}
