"""What a request keeps besides the weights, from a folder's configs alone: closed forms per
pipeline class (REQUEST_FORMS) for its latents and conditioning, its token grid, and the latent its
VAE decodes. Each is checked against the family's own encode and prepare (tests/test_fit.py)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from ..models.families import FamilyAdapter
from .folder import ModelFolder, ModelFolderError, read_json


@dataclass(frozen=True)
class Call:
    """The request a plan is for: size, frames, prompts, branches and the family's options."""

    height: int
    width: int
    prompts: int
    branches: int
    options: dict


@dataclass(frozen=True)
class RequestShape:
    """What a request keeps besides the weights, in bytes, and its token layout."""

    latents_per_prompt: int
    conditioning_per_row: int  # one prompt, one branch
    shared: int  # conditioning that no row has (Flux's ids, CogVideoX's rotary tables)
    grid: tuple[int, int]  # (rows, cols) of tokens PipeFusion cuts into patches (a video's frames stacked as rows)
    decode_latent: tuple[int, int, int] | None  # (channels, rows, cols) an AutoencoderKL decodes; None: no closed form
    frames: int = 1  # latent frames (video)
    bounds: tuple[str, ...] = ()  # terms that are upper bounds, and why

    @property
    def image_tokens(self) -> int:
        return self.grid[0] * self.grid[1]


def _vae_scale(vae: dict) -> tuple[int, int]:
    """(spatial, temporal) downsampling of a VAE, from its config as each pipeline computes it."""
    if "temperal_downsample" in vae:  # Wan's and Qwen-Image's VAE
        return 2 ** len(vae["temperal_downsample"]), 2 ** sum(vae["temperal_downsample"])
    if "spatial_compression_ratio" in vae:  # HunyuanVideo's
        return vae["spatial_compression_ratio"], vae.get("temporal_compression_ratio", 1)
    return 2 ** (len(vae["block_out_channels"]) - 1), vae.get("temporal_compression_ratio", 1)


def _text_length(folder: ModelFolder, tokenizer: str, encoder: str) -> int:
    """CLIP's padded length: its tokenizer's model_max_length where the folder has the tokenizer's
    config, else the encoder's positions (77), which is what the published tokenizers say."""
    length = folder.configs.get(tokenizer, {}).get("model_max_length")
    if isinstance(length, int) and length < 10**6:
        return length
    return folder.configs[encoder]["max_position_embeddings"]


def _packed(folder: ModelFolder, call: Call, e: int) -> tuple[int, int, int]:
    """Flux's and Qwen-Image's packed latents: 2 × 2 latent pixels a token. (rows, cols, bytes per prompt)."""
    scale = _vae_scale(folder.configs["vae"])[0]
    rows, cols = call.height // (scale * 2), call.width // (scale * 2)
    return rows, cols, rows * cols * folder.configs["transformer"]["in_channels"] * e


def _flux(folder: ModelFolder, call: Call, e: int) -> RequestShape:
    t = folder.configs["transformer"]
    rows, cols, latents = _packed(folder, call, e)
    text = call.options["max_sequence_length"]
    per_row = text * t["joint_attention_dim"] * e + t["pooled_projection_dim"] * e
    shared = text * 3 * e + rows * cols * 3 * e  # txt_ids and img_ids [tokens, 3], in the text's dtype
    channels = folder.configs["vae"]["latent_channels"]
    return RequestShape(latents, per_row, shared, (rows, cols), (channels, 2 * rows, 2 * cols))


def _qwen_image(folder: ModelFolder, call: Call, e: int) -> RequestShape:
    t = folder.configs["transformer"]
    rows, cols, latents = _packed(folder, call, e)
    text = call.options["max_sequence_length"]
    per_row = text * (t["joint_attention_dim"] * e + 1)  # states and the bool mask, at most `text` tokens
    why = (
        f"conditioning: at most max_sequence_length {text} text tokens a row; Qwen-Image pads a batch to its "
        f"longest prompt, whose length is known only once it is tokenized"
    )
    return RequestShape(latents, per_row, 0, (rows, cols), None, bounds=(why,))


def _sd3(folder: ModelFolder, call: Call, e: int) -> RequestShape:
    t = folder.configs["transformer"]
    scale = _vae_scale(folder.configs["vae"])[0]
    rows, cols = call.height // scale, call.width // scale
    text = _text_length(folder, "tokenizer", "text_encoder") + call.options["max_sequence_length"]  # [CLIP; T5]
    per_row = text * t["joint_attention_dim"] * e + t["pooled_projection_dim"] * e
    patch = t["patch_size"]
    latents = t["in_channels"] * rows * cols * e
    return RequestShape(latents, per_row, 0, (rows // patch, cols // patch), (t["in_channels"], rows, cols))


def _pixart(folder: ModelFolder, call: Call, e: int) -> RequestShape:
    t = folder.configs["transformer"]
    height, width = _pixart_binned(t, call)
    scale = _vae_scale(folder.configs["vae"])[0]
    rows, cols = height // scale, width // scale
    text = call.options["max_sequence_length"]
    width_t5 = folder.configs["text_encoder"]["d_model"]
    micro = 3 * e if t["sample_size"] == 128 else 0  # the recipe's resolution [2] and aspect ratio [1] per row
    per_row = text * width_t5 * e + text * 8 + micro  # states, the tokenizer's int64 mask
    patch = t["patch_size"]
    latents = t["in_channels"] * rows * cols * e
    vae = folder.configs["vae"]["latent_channels"]
    return RequestShape(latents, per_row, 0, (rows // patch, cols // patch), (vae, rows, cols))


def _pixart_binned(transformer: dict, call: Call) -> tuple[int, int]:
    """The size PixArt's pipeline really renders: the nearest aspect-ratio bin, when binning is on."""
    if not call.options.get("use_resolution_binning", True):
        return call.height, call.width
    from diffusers.image_processor import PixArtImageProcessor

    from ..pipelines.pixart import BINS

    if transformer["sample_size"] not in BINS:
        raise ValueError(
            f"resolution binning needs a sample size of 32, 64 or 128, not {transformer['sample_size']}; "
            f"pass use_resolution_binning=False"
        )
    return PixArtImageProcessor.classify_height_width_bin(call.height, call.width, BINS[transformer["sample_size"]])


def _video_frames(folder: ModelFolder, call: Call) -> int:
    temporal = _vae_scale(folder.configs["vae"])[1]
    return (call.options["num_frames"] - 1) // temporal + 1


def _cogvideox(folder: ModelFolder, call: Call, e: int) -> RequestShape:
    t = folder.configs["transformer"]
    scale = _vae_scale(folder.configs["vae"])[0]
    frames = _video_frames(folder, call)
    patch_t = t.get("patch_size_t") or 1
    frames += -frames % patch_t  # CogVideoX 1.5 pads the latent frames to its temporal patch
    rows, cols = call.height // scale, call.width // scale
    latents = frames * t["in_channels"] * rows * cols * e
    per_row = call.options["max_sequence_length"] * t["text_embed_dim"] * e
    patch = t["patch_size"]
    grid = (frames // patch_t * (rows // patch), cols // patch)
    shared = 0
    if t.get("use_rotary_positional_embeddings"):  # (cos, sin) [tokens, head_dim], float32
        shared = 2 * grid[0] * grid[1] * t["attention_head_dim"] * 4
    return RequestShape(latents, per_row, shared, grid, None, frames)


def _wan(folder: ModelFolder, call: Call, e: int) -> RequestShape:
    t = folder.configs["transformer"]
    scale = _vae_scale(folder.configs["vae"])[0]
    frames = _video_frames(folder, call)
    rows, cols = call.height // scale, call.width // scale
    latents = t["in_channels"] * frames * rows * cols * 4  # WanPipeline keeps its latents in float32
    per_row = call.options["max_sequence_length"] * t["text_dim"] * e
    pt, ph, pw = FamilyAdapter.video_patch(t)
    return RequestShape(latents, per_row, 0, (frames // pt * (rows // ph), cols // pw), None, frames)


def _hunyuan_video(folder: ModelFolder, call: Call, e: int) -> RequestShape:
    t = folder.configs["transformer"]
    scale = _vae_scale(folder.configs["vae"])[0]
    frames = _video_frames(folder, call)
    rows, cols = call.height // scale, call.width // scale
    latents = t["in_channels"] * frames * rows * cols * 4  # float32, as HunyuanVideoPipeline keeps them
    text = call.options["max_sequence_length"]  # Llama's states padded to it, with a mask in the model's dtype
    per_row = text * t["text_embed_dim"] * e + text * e + t["pooled_projection_dim"] * e
    pt, ph, pw = FamilyAdapter.video_patch(t)
    return RequestShape(latents, per_row, 0, (frames // pt * (rows // ph), cols // pw), None, frames)


def _square_default(side_key: str | int):
    def default(folder: ModelFolder) -> tuple[int, int]:
        side = side_key if isinstance(side_key, int) else folder.configs["transformer"][side_key]
        scale = _vae_scale(folder.configs["vae"])[0]
        return side * scale, side * scale

    return default


def _cogvideox_default(folder: ModelFolder) -> tuple[int, int]:
    t, scale = folder.configs["transformer"], _vae_scale(folder.configs["vae"])[0]
    return t["sample_height"] * scale, t["sample_width"] * scale


@dataclass(frozen=True)
class RequestForm:
    """A pipeline class's closed form: what a request keeps, its default size, what its sizes must be
    multiples of (pixels), and option defaults the recipe leaves to the pipeline or the transformer."""

    shape: object  # (folder, call, element bytes) -> RequestShape
    default_size: object  # folder -> (height, width)
    multiple: object  # folder -> pixels
    option_defaults: object = None  # folder -> {option: value} where the recipe's is None


def _multiple(patched: bool = True, packed: bool = False):
    def multiple(folder: ModelFolder) -> int:
        t, scale = folder.configs["transformer"], _vae_scale(folder.configs["vae"])[0]
        if packed:
            return scale * 2
        patch = t.get("patch_size") or 1
        return scale * (patch[-1] if isinstance(patch, (list, tuple)) else patch) if patched else scale

    return multiple


REQUEST_FORMS = {
    "FluxPipeline": RequestForm(_flux, _square_default(128), _multiple(packed=True)),
    "QwenImagePipeline": RequestForm(_qwen_image, _square_default(128), _multiple(packed=True)),
    "StableDiffusion3Pipeline": RequestForm(_sd3, _square_default("sample_size"), _multiple()),
    "PixArtAlphaPipeline": RequestForm(_pixart, _square_default("sample_size"), _multiple()),
    "PixArtSigmaPipeline": RequestForm(_pixart, _square_default("sample_size"), _multiple()),
    "CogVideoXPipeline": RequestForm(
        _cogvideox,
        _cogvideox_default,
        _multiple(),
        lambda folder: {"num_frames": folder.configs["transformer"]["sample_frames"]},
    ),
    "WanPipeline": RequestForm(_wan, lambda folder: (480, 832), _multiple()),
    "HunyuanVideoPipeline": RequestForm(_hunyuan_video, lambda folder: (720, 1280), _multiple()),
}


def request_shape(folder: ModelFolder, call: Call) -> RequestShape:
    return REQUEST_FORMS[folder.pipeline_class].shape(folder, call, folder.element)


def make_call(
    folder: ModelFolder,
    *,
    height: int | None = None,
    width: int | None = None,
    batch: int = 1,
    use_cfg: bool | None = None,
    options: dict | None = None,
) -> Call:
    """The request a plan is for: the folder's call defaults (call_defaults.json) over the family's,
    what the caller passes over both, and the branches the family's recipe runs for it."""
    from ..pipelines import recipe_for
    from ..pipelines.base import Request

    if folder.pipeline_class not in REQUEST_FORMS:
        raise ModelFolderError(
            f"the planner has no closed form for {folder.pipeline_class}'s latents and conditioning; "
            f"pipelines it plans: {', '.join(REQUEST_FORMS)}"
        )
    if "vae" not in folder.configs:
        raise ModelFolderError(
            f"{folder.path} has no vae component: the planner sizes the latents from the VAE's config; "
            f"copy the whole pipeline folder"
        )
    form, recipe = REQUEST_FORMS[folder.pipeline_class], recipe_for(folder.pipeline_class)
    defaults_file = folder.path / "call_defaults.json"
    call_defaults = read_json(defaults_file, "call defaults") if defaults_file.is_file() else {}
    merged = {**recipe.defaults, **recipe.options, **call_defaults, **(options or {})}
    if form.option_defaults is not None:
        merged.update({k: v for k, v in form.option_defaults(folder).items() if merged.get(k) is None})
    if merged.get("max_sequence_length") is None:  # the pipeline's own default (PixArt-α 120, PixArt-Σ 300)
        import diffusers

        signature = inspect.signature(getattr(diffusers, folder.pipeline_class).__call__)
        merged["max_sequence_length"] = signature.parameters["max_sequence_length"].default
    default = form.default_size(folder)
    height = height or merged.get("height") or default[0]
    width = width or merged.get("width") or default[1]
    multiple = form.multiple(folder)
    bad = [f"{name} {value}" for name, value in (("height", height), ("width", width)) if value % multiple]
    if bad:
        raise ValueError(
            f"{' and '.join(bad)} not a multiple of {multiple} (the VAE's downsampling × the patch size) for "
            f"{folder.pipeline_class}; use e.g. {height // multiple * multiple or multiple}"
        )
    if use_cfg is None:
        request = Request(["?"] * batch, None, 1, merged.get("guidance_scale"), height, width, 0)
        request.options = {k: merged[k] for k in recipe.options}
        use_cfg = recipe.do_cfg(request)
    return Call(height, width, batch, 2 if use_cfg else 1, merged)
