"""The request terms: what a request keeps on a rank besides the weights, from the folder's configs alone.

the call       make_call: the folder's call defaults over the family's, the caller's over both; the load
               plans one prompt at its call defaults (load_call), a negative prompt counted as given
latents,       request_shape: each family recipe's closed form (Recipe.planned_request, in
conditioning   xdit_lab/families/<family>.py), checked against the family's own encode and prepare on
               tiny pipelines (tests/test_fit.py)
stale K/V      PipeFusion's buffers on the busiest rank of the busiest stage: the layers the family
               adapter counts (FamilyAdapter.stale_kv_layers), the busiest rank's batch rows (kv_rows),
               attention/stale.py's stale_kv_bytes; and a linear attention's sums and a convolution's
               edge rows per patch (Sana's: stale_sums_and_halos)
decode peak    the VAE decode's activations, whole or in row bands (planned_decode_peak): the 2D decoder's
               (decode_peak_bytes; AutoencoderKL, Flux.2's), Wan's causal 3D one's (video_decode.py),
               CogVideoX's (cogvideox_decode.py), HunyuanVideo's and HunyuanVideo-1.5's (hunyuan_decode.py), LTX-2's
               (ltx2_decode.py)
"""

from __future__ import annotations

import inspect

from ..config import ParallelConfig
from ..families import RECIPES, Recipe, Request
from ..families.recipe import Call, RequestShape, latent_frames, vae_scale
from ..model_folder import ModelFolder, ModelFolderError, read_call_defaults
from ..sharding import batch_rows
from ..vae import CAUSAL_VAES, PLANAR_VAES
from .cogvideox_decode import cogvideox_decode_peak_bytes
from .hunyuan_decode import hunyuan15_decode_peak_bytes, hunyuan_decode_peak_bytes
from .ltx2_decode import ltx2_decode_peak_bytes
from .video_decode import wan_decode_peak_bytes

VIDEO_DECODE_PEAKS = {  # each video VAE's closed form, checked against measured peaks in tests/test_vae.py
    "AutoencoderKLWan": wan_decode_peak_bytes,
    "AutoencoderKLQwenImage": wan_decode_peak_bytes,
    "AutoencoderKLCogVideoX": cogvideox_decode_peak_bytes,
    "AutoencoderKLHunyuanVideo": hunyuan_decode_peak_bytes,
    "AutoencoderKLHunyuanVideo15": hunyuan15_decode_peak_bytes,
    "AutoencoderKLLTX2Video": ltx2_decode_peak_bytes,
}
UNPLANNED_DECODES = {  # the VAEs whose decode peak has no closed form here yet, and why
    "AutoencoderDC": "Sana's deep-compression decoder (its own blocks, linear attention) has no ledger here",
}

__all__ = ["Call", "RequestShape", "make_call", "request_shape"]


def request_shape(folder: ModelFolder, call: Call) -> RequestShape:
    """What `call` keeps besides the weights on a rank that holds the whole batch (latents, conditioning)."""
    return folder.recipe.planned_request(folder.configs, call, folder.element)


def make_call(
    folder: ModelFolder,
    *,
    height: int | None = None,
    width: int | None = None,
    batch: int = 1,
    use_cfg: bool | None = None,
    options: dict | None = None,
    call_defaults: dict | None = None,
) -> Call:
    """The request a plan is for: the folder's call defaults (call_defaults.json, or `call_defaults` as the load
    read them) over the family's, what the caller passes over both, and the branches the family's recipe runs
    for it."""
    if folder.pipeline_class not in RECIPES:
        raise ModelFolderError(
            f"xdit_lab does not run {folder.pipeline_class}, so it plans no memory for it; pipelines it runs: "
            f"{', '.join(RECIPES)}"
        )
    recipe = folder.recipe
    if type(recipe).planned_request is Recipe.planned_request:
        raise ModelFolderError(
            f"the planner has no closed form for {folder.pipeline_class}'s latents and conditioning yet "
            f"({recipe.family}'s recipe has no planned_request); plan it on a loaded pipeline: "
            f"pipe.memory_plan_for(prompts)"
        )
    if "vae" not in folder.configs:
        raise ModelFolderError(
            f"{folder.path} has no vae component: the planner sizes the latents from the VAE's config; "
            f"copy the whole pipeline folder"
        )
    if call_defaults is None:
        call_defaults = read_call_defaults(folder.path, recipe)
    merged = {**recipe.call_defaults(folder.pipeline_class), **recipe.options, **call_defaults, **(options or {})}
    merged.update({k: v for k, v in recipe.planned_option_defaults(folder.configs).items() if merged.get(k) is None})
    if merged.get("max_sequence_length") is None:  # the pipeline's own default (PixArt-α 120, PixArt-Σ 300)
        import diffusers

        parameter = inspect.signature(getattr(diffusers, folder.pipeline_class).__call__).parameters.get(
            "max_sequence_length"
        )  # None: the pipeline's lengths are its own (HunyuanVideo-1.5's)
        merged["max_sequence_length"] = None if parameter is None else parameter.default
    default = recipe.planned_default_size(folder.configs)
    height = height or merged.get("height") or default[0]
    width = width or merged.get("width") or default[1]
    multiple = recipe.planned_multiple(folder.configs)
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


def load_call(folder: ModelFolder, call_defaults: dict) -> Call:
    """The request a load is planned for: one prompt at the call defaults, with load_branches' branches."""
    branches = load_branches(folder.recipe, call_defaults)
    return make_call(folder, use_cfg=branches == 2, call_defaults=call_defaults)


def load_branches(recipe: Recipe, call_defaults: dict) -> int:
    """The branches of one prompt at the call defaults as the recipe decides them, a negative prompt counted as
    given since a call may bring one (true-CFG families, Qwen-Image, have two branches only with it)."""
    options = {key: value for key, value in call_defaults.items() if key in recipe.options}
    negatives = None if recipe.cfg_needs is None else [""]
    default = Request(["a prompt"], negatives, 1, call_defaults["guidance_scale"], None, None, None)
    default.options = recipe.check_options(options)
    return 2 if recipe.do_cfg(default) else 1


def kv_rows(config: ParallelConfig, total: int) -> int:
    """The most batch rows of `total` ([unconditional; conditional]) that one rank computes under `config`, as the
    forward splits them (batch_rows): the rows its stale K/V is kept for. One branch under cfg 2 is a call the
    session refuses: its rows as under cfg 1."""
    cfg = config.cfg if total % 2 == 0 else 1
    return max(
        stop - start
        for c in range(cfg)
        for d in range(config.dp)
        for start, stop, _ in [batch_rows(total, cfg, config.dp, c, d)]
    )


def stale_layers(folder: ModelFolder) -> list[int]:
    """Per transformer block, its attention layers whose image K/V a PipeFusion stage keeps, named in the header
    by their K projections and counted by the family adapter (FamilyAdapter.stale_kv_layers); kept on the folder."""
    if folder.stale_layers is None:
        keys = folder.transformer.names
        names = [key.removesuffix(".to_k.weight") for key in keys if key.endswith(".to_k.weight")]
        folder.stale_layers = folder.adapter.stale_kv_layers(names, folder.transformer.config)
    return folder.stale_layers


def stale_kv(folder: ModelFolder, call: Call, shape: RequestShape, config: ParallelConfig, span) -> int:
    """PipeFusion's stale K/V on a stage holding blocks [start, stop): its self/joint attention layers, the busiest
    rank's batch rows, this rank's tokens (attention/stale.py's stale_kv_bytes)."""
    layers = sum(stale_layers(folder)[span[0] : span[1]])
    rows = kv_rows(config, call.prompts * call.branches)
    kv = busiest_stale_kv_bytes(
        config, folder.adapter, folder.transformer.config, layers, rows, shape.grid, folder.element
    )
    return (
        kv
        + stale_sums_and_halos(folder, config, span, rows, shape.grid)
        + whole_query_kv(folder, config, span, rows, shape.grid)
    )


def whole_query_kv(folder: ModelFolder, config: ParallelConfig, span, rows: int, grid) -> int:
    """The K/V a stage keeps of its "whole_queries" layers (LTX-2's video-to-audio attention): every patch's image
    tokens of the busiest sp rank, every head, as wide as the stream beside the image that queries them
    (FamilyAdapter.beside: LTX-2's audio, whose heads that attention has)."""
    from ..sharding import patch_layout

    adapter, transformer = folder.adapter, folder.transformer.config
    if adapter.beside is None:
        return 0
    names = [key.removesuffix(".to_k.weight") for key in folder.transformer.names if key.endswith(".to_k.weight")]
    blocks = [
        adapter.block_index(f"{name}.", transformer)
        for name in names
        if adapter.attention_kind(name) == "whole_queries"
    ]
    layers = sum(1 for block in blocks if block is not None and span[0] <= block < span[1])
    layout = patch_layout(
        grid, config.patches, config.sp_degree, padded=adapter.latents.padded_tokens(grid[0] * grid[1], transformer)
    )
    own = max(sum(layout.chunk_len(p, r) for p in range(len(layout.patches))) for r in range(config.sp_degree))
    return layers * 2 * rows * adapter.beside.width(transformer) * own * folder.element


def stale_sums_and_halos(folder: ModelFolder, config: ParallelConfig, span, rows: int, grid) -> int:
    """What a stage keeps besides K/V of its blocks [start, stop): a linear attention's sums and a convolution's
    edge rows per patch (Sana's; the family adapter counts the layers, FamilyAdapter.stale_mixing_layers)."""
    from ..attention.linear import stale_sums_bytes

    adapter, transformer = folder.adapter, folder.transformer.config
    if adapter.row_convolution is None and "linear" not in adapter.attention.values():
        return 0
    names = {key.rsplit(".", cut)[0] for key in folder.transformer.names for cut in range(1, key.count(".") + 1)}
    counts = adapter.stale_mixing_layers(sorted(names), transformer)[span[0] : span[1]]
    linear, convolving = (sum(c) for c in zip(*counts)) if counts else (0, 0)
    heads, head_dim = adapter.attention_shape(transformer)
    kept = stale_sums_bytes(linear, rows, heads, head_dim, config.patches)
    if adapter.row_convolution is not None:
        width = heads * head_dim
        kept += adapter.row_convolution.stale_halo_bytes(convolving, rows, grid, config.patches, width, folder.element)
    return kept


def busiest_stale_kv_bytes(
    config: ParallelConfig, adapter, transformer: dict, layers: int, rows: int, grid, element: int
) -> int:
    """The stale K/V buffers of a PipeFusion stage's busiest rank under `config` (the ring rank that keeps
    the most: stale_kv_bytes), for `layers` attention layers whose K/V it keeps, `rows` batch rows, a
    `grid` (rows, cols) of tokens (and the tokens the model pads it with) and the heads of the transformer's
    config.json (`transformer`, read through the family's `adapter`), with `element` bytes per float. A tp rank
    keeps the K/V of its 1/tp of the heads."""
    from ..attention.stale import stale_kv_bytes

    heads, head_dim = adapter.attention_shape(transformer)
    heads //= config.tp

    return max(
        stale_kv_bytes(
            layers=layers,
            rows=rows,
            heads=heads,
            head_dim=head_dim,
            grid=grid,
            padded=adapter.latents.padded_tokens(grid[0] * grid[1], transformer),
            patches=config.patches,
            ulysses=config.ulysses,
            ring=config.ring,
            ring_rank=ring_rank,
            element_bytes=element,
        )
        for ring_rank in range(config.ring)
    )


def decode_bands(config: ParallelConfig) -> int:
    """Row bands the VAE decodes one image in: over the ranks that share it (vae.py), or whole."""
    return config.sp_degree * config.pipefusion if config.vae_parallel else 1


def planned_decode_peak(folder: ModelFolder, call: Call, shape: RequestShape, bands: int = 1) -> int | None:
    """The decode peak of one image or video of `call` on a rank holding the largest of `bands` row bands: the 2D
    decoder's (decode_peak_bytes) or the video VAE's (VIDEO_DECODE_PEAKS); None for a VAE with no closed form here
    (decoded_latent says which)."""
    latent = decoded_latent(folder, call, shape)
    if latent is None:
        return None
    vae = folder.configs["vae"]
    if len(latent) == 5:
        return VIDEO_DECODE_PEAKS[vae["_class_name"]](vae, latent, folder.element, bands=bands)
    return decode_peak_bytes(vae, latent, folder.element, bands=bands)


def decoded_latent(folder: ModelFolder, call: Call, shape: RequestShape) -> tuple[int, ...] | None:
    """The latent one decode takes, (1, channels, rows, cols) for the 2D decoder (PLANAR_VAES, the recipe's
    decode_latent), (1, channels, frames, rows, cols) for a video VAE (VIDEO_DECODE_PEAKS: the video's latent
    frames, as the VAE compresses time); None for the others (Sana's AutoencoderDC: no closed form yet)."""
    vae = folder.configs.get("vae", {})
    kind = vae.get("_class_name")
    if kind in PLANAR_VAES and shape.decode_latent is not None:
        return (1, *shape.decode_latent)
    if kind in VIDEO_DECODE_PEAKS:
        scale = vae_scale(vae)[0]
        # Wan's: the frames the recipe planned; the others': the video's own (CogVideoX 1.5 pads the latent
        # frames to its temporal patch for the transformer and decodes them without the padding)
        frames = shape.frames if kind in CAUSAL_VAES else latent_frames(folder.configs, call)
        channels = vae.get("z_dim", 16) if kind in CAUSAL_VAES else vae.get("latent_channels", 16)
        return (1, channels, frames, call.height // scale, call.width // scale)
    return None


def decode_peak_bytes(vae_config: dict, latent_shape, element_bytes: int, *, bands: int = 1) -> int:
    """The most bytes an AutoencoderKL decode holds at once (weights and the latent not counted),
    from its configuration: the largest set of activations alive together, in units of channels
    × pixels at each resolution (diffusers' decoder, step by step):

        resnet c_in -> c_out     input (held by the caller) + shortcut, hidden, sum, sum / scale
        ×2 upsample of c         input + interpolated (4×) + convolved (4×)
        mid attention            input, norm, q, k, v, out, projection (flash kernels: no scores);
                                 in bands Ring's two K/V buffers and the merged partial outputs

    In bands (vae.py) a rank holds its band's rows (the largest band) and every 3×3 convolution
    also a copy of its input with the halo rows. Against lab.measure.PeakTensorBytes on CPU
    (tests/test_vae.py): exact for the whole decode, within 5% in bands."""
    batch, latent_channels, rows, cols = latent_shape
    rows = -(-rows // bands)
    blocks = list(reversed(vae_config["block_out_channels"]))

    def pixels(scale):  # (a band's pixels, its convolutions' input with halo rows) at this scale
        band = rows * scale * cols * scale
        return band, (band + 2 * cols * scale if bands > 1 else 0)

    top = blocks[0]
    p, halo = pixels(1)
    # the post-quant latent, held while the decoder runs
    held = latent_channels * p if vae_config.get("use_post_quant_conv", True) else 0
    peaks = [latent_channels * (p + halo) + top * p, 4 * top * p]
    if vae_config.get("mid_block_add_attention", True):
        attention = 7 if bands == 1 else 16  # Ring adds two K/V buffers (2 each), partial outputs and their merge
        peaks.append(attention * top * p)
    previous, scale = top, 1
    for i, out in enumerate(blocks):
        p, halo = pixels(scale)
        block_input = previous * p  # held by the decoder's loop until the up block returns
        for j in range(vae_config["layers_per_block"] + 1):
            c_in, also_held = (previous, 0) if j == 0 else (out, block_input)
            end = (c_in + 4 * out if c_in != out else 4 * out) * p  # shortcut, hidden, sum, sum / scale
            first_conv = 2 * c_in * p + c_in * halo + out * p  # input, activation, its halo copy, output
            peaks += [also_held + end, also_held + first_conv]
        if i < len(blocks) - 1:
            scale *= 2
            high, high_halo = pixels(scale)
            peaks.append(block_input + out * (p + 2 * high + high_halo))
        previous = out
    first = vae_config["block_out_channels"][0]
    p, halo = pixels(scale)
    peaks.append(3 * first * p + first * halo + 3 * p)  # norm, activation, conv_out to RGB
    return batch * (held + max(peaks)) * element_bytes
