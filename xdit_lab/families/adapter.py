"""FamilyAdapter: what xdit_lab needs to know of a diffusers DiT family to run it in parallel, as data.

No forward is copied: diffusers' model runs unchanged, and models/hooks.py takes over at the places an
adapter names (where the image tokens are sharded and gathered, where the rotary tables are, which
attention module is which kind), while the token strategy (models/sequence.py, models/pipefusion/)
reads the layouts below to cut tokens, rotary rows and latents the way this family holds them.

Attention kinds (matched on the module's qualified name):
    self        image tokens only: sequence-parallel
    cross       image queries, text keys/values (PixArt): local, no communication
    joint_first text tokens before image tokens in q/k/v (Flux, Flux.2, CogVideoX, Qwen-Image)
    joint_last  text tokens after image tokens (SD3, HunyuanVideo, Z-Image's main layers)
    text        text tokens alone (HunyuanVideo's token refiner, Z-Image's caption refiner): whole on every
                rank, runs as it is
    linear      image tokens only, linear attention (Sana): no SDPA; its sums over the tokens are the
                strategy's (models/linear_attention.py), reduced over the sequence-parallel ranks
    whole_queries  queries whole on every rank, keys/values the image tokens (LTX-2's video-to-audio attention,
                the audio asking the video): each rank attends to the keys it holds, and the partial outputs
                are merged by their log-sum-exp over the sequence-parallel ranks

The first three are the image's own attention: its image tokens are sharded, so it is sequence-parallel,
and a PipeFusion stage keeps its image K/V per patch from step to step (SEQUENCE_PARALLEL_KINDS).

Latent layouts (how `hidden_states` hold one sample, and in which order the model's tokens run):
    IMAGE    [C, H, W]       p × p pixels a token, row-major            PixArt, SD3, DiT
    TOKENS   [S, C]          packed tokens, a token a row              Flux, Flux.2, Qwen-Image
    FRAMES   [F, C, H, W]    frame-major, then rows (CogVideoX)
    VIDEO    [C, F, H, W]    (t, h, w) patches, frame-major            Wan, HunyuanVideo
Rotary layouts (what the module at `rotary_at` returns):
    TEXT_THEN_IMAGE  rows for [text; image], a table or (cos, sin)                      Flux
    IMAGE_ONLY       (cos, sin) of image tokens only, [1, S, 1, D] or [S, D]            Wan, HunyuanVideo
    IMAGE_AND_TEXT   (image rows [S, D], text rows [T, D])                             Qwen-Image
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

SEQUENCE_PARALLEL_KINDS = ("self", "joint_first", "joint_last")
# the kinds whose attention the token strategy computes (the sequence-parallel ones, and queries whole on every rank
# against the image's keys); a PipeFusion stage keeps stale K/V of the first only
STRATEGY_KINDS = (*SEQUENCE_PARALLEL_KINDS, "whole_queries")


def norm1_modulated(block, argument) -> torch.Tensor:
    """TeaCache's modulated input (FamilyAdapter.teacache) of a block whose norm1 is diffusers' AdaLayerNormZero
    (Flux's, HunyuanVideo's double-stream blocks): norm1(hidden_states, emb=temb)'s normed, shifted and scaled
    states, what the block's attention takes."""
    return block.norm1(argument("hidden_states"), emb=argument("temb"))[0]


# ---- latent layouts --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LatentLayout:
    """How `hidden_states` hold the image of one sample, and the order of the model's image tokens."""

    name = ""
    channel_dim = 1  # where the output's channels sit in [B, ...]

    def patch_size(self, model_config) -> int:
        return model_config.get("patch_size") or 1

    def token_grid(self, latents, model_config, arguments) -> tuple[int, int]:
        """(rows, cols) of the image tokens in the order the model holds them; PipeFusion cuts its
        patches as bands of rows (a video's frames stack as rows)."""
        patch = self.patch_size(model_config)
        return latents.shape[-2] // patch, latents.shape[-1] // patch

    def appended_grids(self, arguments) -> tuple[tuple[int, int], ...]:
        """(rows, cols) of the images whose tokens follow the drawn one's in the forward's sequence (an
        edit's reference images), which PipeFusion cuts into row bands with it: none here."""
        return ()

    def latent_positions(self, latents, model_config) -> torch.Tensor:
        """[S, X]: for each image token, in the model's order, the flat positions in one sample of
        `latents` it is made of. PipeFusion's async schedule steps the scheduler patch by patch and
        sends a patch's latents back to stage 0: these are that patch's elements."""
        c, h, w = latents.shape[1:]
        p = self.patch_size(model_config)
        flat = torch.arange(c * h * w, device=latents.device)
        return flat.view(c, h // p, p, w // p, p).permute(1, 3, 0, 2, 4).reshape(h * w // p**2, -1)

    def prediction_shape(self, latents, model_config) -> tuple[int, ...]:
        """The shape of the model's output for `latents`: the latents with the output channels."""
        channels = model_config.get("out_channels") or model_config.get("in_channels")
        dim = self.channel_dim
        return (*latents.shape[:dim], self.output_channels(channels, model_config), *latents.shape[dim + 1 :])

    def output_channels(self, channels: int, model_config) -> int:
        return channels

    def padded_tokens(self, tokens: int, model_config) -> int:
        """Tokens the model adds after an image's `tokens` before its blocks, sharded and gathered with them and
        dropped from its output (Z-Image pads to a multiple of 32): none here."""
        return 0

    def patch_grid(self, grid: tuple[int, int]) -> tuple[int, int] | None:
        """The (rows, cols) PipeFusion cuts into patches, for an image of grid[0] × grid[1] tokens;
        None for a video, whose frames stack more rows than one image has."""
        return grid

    def default_image_tokens(self, model_config) -> int | None:
        """Image tokens at the model's configured sample size (setup-time shape checks); None when the
        config does not say."""
        sample = model_config.get("sample_size")
        return (sample // self.patch_size(model_config)) ** 2 if isinstance(sample, int) else None

    def planned_grid(self, latent: tuple[int, int], model_config) -> tuple[int, int] | None:
        """The token grid PipeFusion cuts, for a latent of (rows, cols) pixels at the default size (the
        memory plan's, before loading); None where the call's frames are needed."""
        return tuple(side // self.patch_size(model_config) for side in latent)


@dataclass(frozen=True)
class ImageLatents(LatentLayout):
    name = "image"  # [B, C, H, W], p × p pixels a token


@dataclass(frozen=True)
class PackedTokens(LatentLayout):
    """[B, S, C]: the pipeline packs 2 × 2 latent pixels into a token before the model sees it."""

    name = "tokens"
    channel_dim = 2

    def token_grid(self, latents, model_config, arguments):
        return self._image_grids(arguments)[0]  # the drawn image's tokens come first

    def appended_grids(self, arguments):
        """The reference images after the drawn one: Qwen-Image-Edit's, img_shapes' entries after the first;
        Kontext's and Flux.2's, the ids' images after the first."""
        return self._image_grids(arguments)[1:]

    @staticmethod
    def _image_grids(arguments) -> tuple[tuple[int, int], ...]:
        """(rows, cols) of each image of the sequence, in its order."""
        if "img_shapes" in arguments:  # Qwen-Image: [(frames, rows, cols)] per sample, the drawn image first
            images = arguments["img_shapes"][0]  # diffusers' rotary reads the first sample's
            images = images if isinstance(images, list) else [images]
            return tuple((frames * rows, cols) for frames, rows, cols in images)
        return _id_grids(arguments["img_ids"])

    def latent_positions(self, latents, model_config):
        return torch.arange(latents.shape[1:].numel(), device=latents.device).view(latents.shape[1:])

    def output_channels(self, channels, model_config):  # a token carries its patch's pixels (Qwen-Image's 2 × 2)
        return channels * self.patch_size(model_config) ** 2

    def default_image_tokens(self, model_config):
        return None  # packed tokens of any length

    def planned_grid(self, latent, model_config):
        return tuple(side // 2 for side in latent)  # the pipelines pack 2 × 2 latent pixels


def _id_grids(ids: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """(rows, cols) of each image in Flux's ids, (image, row, column[, ...]) a token: an image is a run of
    tokens with one value on the first axis (Kontext's reference 1, Flux.2's references 10, 20, ...), its
    rows row-major. Read on the host once per generation (a PipeFusion stage keeps it until reset): one copy of the ids."""
    ids = (ids[0] if ids.dim() == 3 else ids).cpu()  # one sample's: every sample has the same
    first = ids[:, 0]
    bounds = [0, *(torch.nonzero(first[1:] != first[:-1]).flatten() + 1).tolist(), len(first)]
    grids = []
    for number, (start, stop) in enumerate(zip(bounds, bounds[1:])):
        columns = ids[start:stop, 2]
        cols = int(columns.max() - columns.min()) + 1
        if (stop - start) % cols:
            raise NotImplementedError(
                f"image {number} of the sequence has {stop - start} tokens over {cols} columns of ids: not a grid "
                f"of whole rows, which PipeFusion cuts into bands; run it under ulysses, ring, cfg or dp"
            )
        grids.append(((stop - start) // cols, cols))
    return tuple(grids)


@dataclass(frozen=True)
class FrameLatents(LatentLayout):
    """CogVideoX's [B, F, C, H, W]: tokens frame-major (patch_size_t frames a token), then rows."""

    name = "frames"
    channel_dim = 2

    def token_grid(self, latents, model_config, arguments):
        rows, cols = super().token_grid(latents, model_config, arguments)
        frames = -(-latents.shape[1] // (model_config.get("patch_size_t") or 1))
        return frames * rows, cols

    def latent_positions(self, latents, model_config):
        f, c, h, w = latents.shape[1:]
        p, pt = self.patch_size(model_config), model_config.get("patch_size_t") or 1
        if f % pt:
            raise NotImplementedError(f"{f} latent frames do not divide by patch_size_t {pt}")
        flat = torch.arange(f * c * h * w, device=latents.device)
        grouped = flat.view(f // pt, pt, c, h // p, p, w // p, p)
        return grouped.permute(0, 3, 5, 1, 2, 4, 6).reshape(f // pt * (h // p) * (w // p), -1)

    def patch_grid(self, grid):
        return None

    def default_image_tokens(self, model_config):
        patch = self.patch_size(model_config)
        frames = (model_config.sample_frames - 1) // model_config.temporal_compression_ratio + 1
        frames = -(-frames // (model_config.get("patch_size_t") or 1))
        return frames * (model_config.sample_height // patch) * (model_config.sample_width // patch)

    def planned_grid(self, latent, model_config):
        return None  # the frames come with the call (memory_plan_for plans them then)


@dataclass(frozen=True)
class VideoLatents(LatentLayout):
    """Wan's and HunyuanVideo's [B, C, F, H, W], (t, h, w) patches, tokens frame-major."""

    name = "video"

    @staticmethod
    def video_patch(model_config) -> tuple[int, int, int]:
        """(frames, rows, cols) of a token: Wan's patch_size tuple, or HunyuanVideo's patch_size and patch_size_t."""
        patch = model_config.get("patch_size")
        if isinstance(patch, (tuple, list)):
            return tuple(patch)
        return model_config.get("patch_size_t") or 1, patch, patch

    def token_grid(self, latents, model_config, arguments):
        (pt, ph, pw), (frames, height, width) = self.video_patch(model_config), latents.shape[-3:]
        return frames // pt * (height // ph), width // pw

    def latent_positions(self, latents, model_config):
        c, f, h, w = latents.shape[1:]
        pt, ph, pw = self.video_patch(model_config)
        flat = torch.arange(c * f * h * w, device=latents.device)
        grouped = flat.view(c, f // pt, pt, h // ph, ph, w // pw, pw)
        return grouped.permute(1, 3, 5, 0, 2, 4, 6).reshape(f // pt * (h // ph) * (w // pw), -1)

    def patch_grid(self, grid):
        return None

    def default_image_tokens(self, model_config):
        return None  # the frames come with the call

    def planned_grid(self, latent, model_config):
        return None  # the frames come with the call (memory_plan_for plans them then)


IMAGE, TOKENS, FRAMES, VIDEO = ImageLatents(), PackedTokens(), FrameLatents(), VideoLatents()


# ---- rotary layouts --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RotaryLayout:
    """What the module at `rotary_at` returns, and how a rank keeps the rows of the tokens it holds."""

    def keep_rows(self, tables, text: int, keep, keep_text=None):
        """The tables' rows of the image tokens a rank holds, and of its text (`text` rows of it in the
        tables). `keep(t, dim)` keeps the rank's image rows of t along dim (a contiguous shard, or a
        stage's active patches); `keep_text(t, dim)` its text rows (None: every text row)."""
        raise NotImplementedError


@dataclass(frozen=True)
class TextThenImage(RotaryLayout):
    """Rows for [text; image]: one table, or (cos, sin) (Flux)."""

    def keep_rows(self, tables, text, keep, keep_text=None):
        def rows(t):
            words = t[:text] if keep_text is None else keep_text(t[:text], 0)
            return torch.cat([words, keep(t[text:], 0)], dim=0)

        return tuple(rows(t) for t in tables) if isinstance(tables, tuple) else rows(tables)


@dataclass(frozen=True)
class ImageOnly(RotaryLayout):
    """(cos, sin) of the image tokens only, [1, S, 1, D] (Wan) or [S, D] (HunyuanVideo)."""

    def keep_rows(self, tables, text, keep, keep_text=None):
        return tuple(keep(t, 1 if t.dim() == 4 else 0) for t in tables)


@dataclass(frozen=True)
class ImageAndText(RotaryLayout):
    """(image rows [S, D], text rows [T, D]) (Qwen-Image)."""

    def keep_rows(self, tables, text, keep, keep_text=None):
        image, text_rows = tables
        return keep(image, 0), text_rows if keep_text is None else keep_text(text_rows, 0)


TEXT_THEN_IMAGE, IMAGE_ONLY, IMAGE_AND_TEXT = TextThenImage(), ImageOnly(), ImageAndText()


# ---- arguments with one entry per image token ----------------------------------------------------------


@dataclass(frozen=True)
class PerToken:
    """An argument with one entry per image token: each rank keeps the entries of the tokens it holds,
    cut with the same shard (ulysses, ring) or the same patches (PipeFusion) as the tokens themselves,
    so it is exact and moves nothing. diffusers' `_cp_plan` says the same with ContextParallelInput.

        Wan 2.2 TI2V's timestep [B, S] at the forward     -> this rank's [B, S/sp]
        Qwen-Image-Edit's modulate_index [B, S] per block  -> [B, S/sp]
        HunyuanVideo I2V's frame-0 token count F0 (an int) -> how many of this rank's tokens are among the first F0
        a ControlNet's residuals [[B, S, D], ...] (Flux, SD3) -> [[B, S/sp, D], ...], added to this rank's states

    module    "" for the transformer's forward, else a regex of the qualified names of the modules that take it
              (a PipeFusion stage renames its blocks from 0: the regex matches them as well)
    argument  its name in that forward (found among the positional arguments too, by the signature)
    dim       the token dimension (negative: from the end, e.g. Flux.2's img_ids [S, 3] or [B, S, 3])
    dims      only a tensor of this many dimensions is per token (Wan's timestep is per sample when 1-D)
    prefix    the argument is a count of the sequence's leading image tokens, not a tensor
    then_text the argument holds the image's tokens, then the joint text's (Z-Image's rotary rows and padding
              mask of the sequence [image; text] its forward joins): the image's entries are cut, and the text's
              "rows" follow the text's share (the strategy's shard_text: rotary rows), or every one of them is kept
              ("keys": a padded-text key mask, which attention reads whole)
    A tuple or list of tensors (CogVideoX's rotary (cos, sin); a ControlNet's residuals, one per block it
    feeds, [B, S, D] each) has each of its tensors cut."""

    module: str
    argument: str
    dim: int = 1
    dims: int | None = None
    prefix: bool = False
    then_text: str | None = None

    def keep(self, strategy, value):
        """`value` as this rank holds it: `strategy` (the token strategy) cuts it or counts it (a RankLocal,
        computed on this rank's tokens already, as it is)."""
        if value is None or isinstance(value, RankLocal):
            return value
        if self.prefix:
            return strategy.keep_prefix(value)
        if isinstance(value, (tuple, list)):
            return type(value)(self.keep(strategy, t) for t in value)
        if isinstance(value, torch.Tensor) and (self.dims is None or value.dim() == self.dims):
            if self.then_text:  # [image; text] on dim: this rank's image entries, then its text's or all of it
                dim, image = self.dim % value.dim(), strategy.state.image_len
                text = value.narrow(dim, image, value.shape[dim] - image)
                if self.then_text == "rows":
                    text = strategy.shard_text(text.movedim(dim, 1)).movedim(1, dim)
                return torch.cat([strategy.keep_tokens(value.narrow(dim, 0, image), dim), text], dim=dim)
            return strategy.keep_tokens(value, self.dim)
        return value


class RankLocal(list):
    """Tensors already this rank's: its batch rows and its image tokens, as a model parallelized on the same
    mesh with the same request cut them. A ControlNet's forward (an adapter without `gather_at`) returns its
    residuals as RankLocal lists, and the base transformer's hooks leave them as they are: no gather before,
    no cut after.

        ControlNet (rank r): x[B/cfg·dp, S/sp, D] per block --as they are--> base transformer (rank r): added
    """


@dataclass(frozen=True)
class BlockResiduals:
    """A forward argument that is a list of residuals, one of which each block of `block_list` adds to its image
    states, picked by the block's index in the whole model (a ControlNet's). A PipeFusion stage holds some of the
    blocks, numbered from 0: it hands its forward the residual each of its blocks would take in the whole model,
    in the order it holds them, so that the forward's own pick lands on it (stage.py):

        whole model, n blocks, residuals R:  block g adds R[index(g, n, len(R), arguments)]
        a stage holding blocks g0..g1:       [R[index(g0, ...)], ..., R[index(g1, ...)]], its block j adds the j-th

    index   the forward's own pick (Flux: g // ceil(n / len(R)), or g % len(R) with controlnet_blocks_repeat; SD3:
            int(g / (n / len(R)))), given the forward's arguments"""

    argument: str
    block_list: str
    index: Callable

    def for_stage(self, residuals: list, held: list[int], blocks: int, arguments: dict) -> list | None:
        """The residuals for a stage holding blocks `held` (their indices in the whole model's list of `blocks`),
        in order; None where it holds none of the list (the forward adds nothing)."""
        if not held:
            return None
        return [residuals[self.index(g, blocks, len(residuals), arguments)] for g in held]


@dataclass(frozen=True)
class RowConvolution:
    """A module that convolves the image tokens laid out [B, C, H, W] (Sana's feed-forward: a 3 × 3 depthwise
    convolution), told the token grid by the blocks that hold it: under sequence shards every rank holds whole
    rows, each block is told this rank's rows, and the module's input gets `reach` rows from each neighbouring
    rank (models/row_halo.py).

    blocks   regex of the blocks whose forward takes the grid's `height` and `width` (a PipeFusion stage
             renames its blocks from 0: the regex matches them as well)
    module   regex of the convolving modules, input [B, C, rows, W]
    reach    rows a convolution reads beyond its own on each side (a 3 × 3 kernel: 1)"""

    blocks: str
    module: str
    height: str = "height"
    width: str = "width"
    reach: int = 1

    def stale_halo_bytes(self, modules: int, rows: int, grid: tuple[int, int], patches: int, width: int, element: int):
        """What a PipeFusion stage keeps of `modules` convolving modules between steps: each patch's first and
        last `reach` rows of each module's input, [rows, width, reach, cols] each (models/pipefusion/stage.py)."""
        return modules * patches * 2 * rows * width * self.reach * grid[1] * element


@dataclass(frozen=True)
class BesideStream:
    """A stream of states the blocks carry beside the image's, whole on every rank (LTX-2's audio): where a block
    returns it as its second output, a PipeFusion stage hands it on with each patch as other families' blocks hand
    their joint text, and the last stage broadcasts its prediction (the forward's second output) with the image's.

    argument  the forward's argument of its latents [B, L, C], shaped as its prediction
    width     (model config) -> the features of its states between blocks (the receive buffer's)"""

    argument: str
    width: Callable


# ---- the adapter -----------------------------------------------------------------------------------------

# the config key that counts each block list, as diffusers' transformers name them (Flux's and
# HunyuanVideo's double-stream blocks, then their single-stream ones; Wan's blocks)
BLOCK_COUNTS = {
    "transformer_blocks": "num_layers",
    "single_transformer_blocks": "num_single_layers",
    "blocks": "num_layers",
}


def diffusers_attention_shape(model_config) -> tuple[int | None, int | None]:
    """(heads, head_dim) of a transformer's attention, as most diffusers configs spell them."""
    return model_config.get("num_attention_heads"), model_config.get("attention_head_dim")


@dataclass(frozen=True)
class FamilyAdapter:
    family: str  # the family's module name in xdit_lab/families, its one spelling
    class_name: str  # diffusers' transformer class
    shard_at: str  # submodule whose output holds the whole image tokens [B, S, C] (positions added)
    # the whole image tokens are shard_at's input (its first argument), not its output: Z-Image pads and embeds
    # them inside its forward, and its image refiner's first block is the first module that takes them [B, S, C]
    shard_at_input: bool = False
    # more submodules whose output holds whole image tokens, cut as shard_at's (an SD3 ControlNet's control image,
    # patch-embedded apart and added to the tokens)
    shard_also: tuple = ()
    # submodule whose output holds this rank's tokens, before unpatchify; None: the forward's outputs stay this
    # rank's (a ControlNet's residuals, RankLocal), neither tokens nor batch gathered
    gather_at: str | None = "proj_out"
    # gather_at's output holds this rank's image tokens, then the joint text (Z-Image's final layer reads the
    # sequence [image; text]): the image's are gathered, the text dropped (the forward reads the image's alone)
    text_after_image_at_gather: bool = False
    attention: dict = field(default_factory=dict)  # qualified-name regex -> kind
    latents: LatentLayout = IMAGE
    text_before_image_at_shard: bool = False  # CogVideoX embeds [text; image] in one tensor
    grid_at_shard: bool = False  # Wan: shard_at gives [B, C, F, H, W]; its tokens are the flattened grid
    rotary_at: str | None = None  # the submodule whose output holds rotary tables, laid out as `rotary`
    # more submodules whose outputs are rotary tables of the image tokens, laid out as `rotary` and cut as
    # rotary_at's (LTX-2's rotary of the video for its audio-video attention)
    rotary_also: tuple = ()
    rotary: RotaryLayout = TEXT_THEN_IMAGE
    text_key_mask: bool = False  # joint attention masks padded text keys, [B, 1, 1, T + S] bool (Qwen-Image)
    # (forward arguments) -> the joint text's length as the blocks take it, where the forward builds that text itself
    # (HunyuanVideo-1.5 joins the image's embeddings, ByT5's and Qwen's tokens; Z-Image pads each caption to a multiple
    # of 32, then the batch to the longest): the batch split notes it, and a PipeFusion stage sizes the text it
    # receives with each patch before the forward runs; None: encoder_hidden_states' length
    joint_text_len: Callable | None = None
    # the blocks' argument holding the joint text's padding mask [B, T], from which each block's attention builds a
    # query-and-key mask [B, 1, L, L] over the tokens it holds (HunyuanVideo-1.5): every block takes this rank's share
    # of it, cut as the text, and the parallel kernels read the whole of it as the text's key mask; None: none
    text_mask_argument: str | None = None
    # (forward arguments) -> the length of the queries a "whole_queries" attention holds whole on every rank (LTX-2's
    # audio tokens), which the traffic's closed form counts; None: the family has none
    whole_query_len: Callable | None = None
    # the forward's argument that holds the latents: a tensor [B, ...], or a list of one tensor per sample
    # (Z-Image's `x`, its batch the list's length)
    latents_argument: str = "hidden_states"
    # a regex of the modules whose output [B, T, C] is the joint text as the blocks take it, its length the
    # forward's text length (Z-Image pads and refines its captions inside the forward); None: the forward's
    # encoder_hidden_states
    text_len_at: str | None = None
    # (heads, head_dim) of the attention, from the model's config (Z-Image: n_heads and dim / n_heads)
    attention_shape: Callable = diffusers_attention_shape
    # where sequence shards cut the joint text: "input", the forward's encoder_hidden_states (and the
    # argument `text_rows_kwarg` with one row per text token, Flux's txt_ids), or "block", as the first
    # block takes it (where the forward needs the whole text before its blocks: rotary positions, a
    # padding mask, one embedding of [text; image]), or "joined", where the first block takes [image; text] as one
    # tensor its forward joined (Z-Image, between its refiners and its layers)
    text_shard_at: str = "block"
    text_rows_kwarg: str | None = None
    # arguments with one entry per image token, which follow the tokens' shard or patch (PerToken)
    per_token: tuple = ()
    # forward arguments that are lists with one entry per sample (Qwen-Image's img_shapes): cfg and dp keep
    # this rank's samples, as they keep its rows of every batched tensor
    per_sample_lists: tuple = ()
    unbatched: tuple = ()  # forward arguments without a batch dimension
    not_batched_dicts: tuple = ("joint_attention_kwargs", "attention_kwargs", "cross_attention_kwargs")
    # why StepCache is not offered, or None: it is offered where it is checked against diffusers' First-Block Cache
    step_cache_refused: str | None = None
    # TeaCache (StepCache(method="teacache")): (first block, argument) -> the block's timestep-modulated input, the
    # tensor TeaCache's rule compares from call to call, where `argument(name)` reads the block's forward argument
    # (Flux: norm1(hidden_states, emb=temb)[0]); None: not offered on the family
    teacache: Callable | None = None
    # diffusers' cache configurations (by class name) whose hooks raise in diffusers' own serial run, and why
    diffusers_cache_refused: dict = field(default_factory=dict)
    # the family's diffusers pipelines (by class name) that open each call's cache context with the scheduler's
    # sigma, which diffusers' SeaCache reads (without it its hooks run every block): WanPipeline's
    cache_sigma_pipelines: tuple = ()
    # why PipeFusion is not offered, or None: it is offered
    pipefusion_refused: str | None = None
    # tensor parallelism (models/tensor_parallel.py): the plan as diffusers writes a `_tp_plan` (module-name globs ->
    # "colwise", "rowwise", PackedColwiseParallel, PackedRowwiseParallel), for a transformer whose class declares
    # none; the per-sample modulation linears split by columns beside it and gathered ([B, k·dim] a block); the
    # RMSNorms over every head at once (qualified-name regexes), computed exactly
    tp_plan: dict | None = None
    tp_gathered: tuple = ()
    tp_head_norms: tuple = ()
    # the tokens the split layers run on where their names do not say it (tensor_parallel.module_tokens):
    # qualified-name regex -> "joint" (the text and the image joined: CogVideoX's blocks), "text" (a joint block's
    # text stream) or "whole_text" (a text refiner before the blocks: the whole text on every rank)
    tp_tokens: dict = field(default_factory=dict)
    # why a family has no tp plan yet, or None: said in tensor parallelism's refusal
    tp_refused: str | None = None
    # lists of residuals the forward hands its blocks by their index in the whole model (a ControlNet's: a
    # PipeFusion stage rebases them to the blocks it holds), BlockResiduals
    block_residuals: tuple = ()
    # a stream the blocks carry beside the image's, whole on every rank (LTX-2's audio: BesideStream), or None
    beside: BesideStream | None = None
    # where blocks that diffusers' TransformerBlockRegistry does not list return their states: block class name ->
    # diffusers' TransformerBlockMetadata fields (Sana's block returns its image states alone)
    block_returns: dict = field(default_factory=dict)
    # a module that convolves over token rows (RowConvolution: Sana's feed-forward), or None
    row_convolution: RowConvolution | None = None
    # PipeFusion cuts the blocks of these lists, concatenated in the forward's order, into stages
    block_lists: tuple = ("transformer_blocks",)
    block_counts: tuple = ()  # the config key holding each list's length; () for diffusers' (BLOCK_COUNTS)
    joined_block_lists: tuple = ()  # lists whose blocks take [text; image] as one tensor (Flux.2's single-stream)
    joined_text_last: bool = False  # ... or [image; text] (Z-Image's main layers)
    # the stacked block before which the forward joins its own joint text to the image tokens (Z-Image's first main
    # layer, "layers.0"; no block before it hands text on): a PipeFusion stage starting there takes the image states
    # of the stage before and its own forward's text; None: the text enters at the first block
    text_joined_at: str | None = None
    # (transformer, block 0, hooks) -> None: what a PipeFusion stage without the model's block 0 installs so that its
    # output layer still gets block 0's conditioning (DiT), or None where the output layer needs nothing of it
    output_conditioning: Callable | None = None
    # submodules the forward calls outside the block that holds them (DiT's output layer takes its
    # conditioning from transformer_blocks.0.norm1.emb after every block ran): sharded weights make each
    # an FSDP2 unit of its own, gathered wherever it is called (models/sharded_weights.py)
    called_outside_their_block: tuple = ()
    # take gather_at, rotary_at, the text's cut and the per-token arguments from the transformer class's own
    # `_cp_plan` (diffusers' context-parallel plan) when the model is parallelized: families/cp_plan.py
    from_cp_plan: bool = False

    def __post_init__(self):
        if not self.block_counts:
            object.__setattr__(self, "block_counts", tuple(BLOCK_COUNTS[name] for name in self.block_lists))

    def attention_kind(self, qualified_name: str) -> str | None:
        for pattern, kind in self.attention.items():
            if re.search(pattern, qualified_name):
                return kind
        return None

    def num_blocks(self, model_config) -> int:
        """Blocks PipeFusion can cut (every list of them, counted from the model's config)."""
        return sum(model_config.get(key) or 0 for key in self.block_counts)

    def block_names(self, model_config) -> list[str]:
        """The stacked blocks' qualified names, in the forward's order."""
        return [
            f"{name}.{i}"
            for name, count in zip(self.block_lists, self.block_counts)
            for i in range(model_config.get(count) or 0)
        ]

    def stage_block_names(self, model_config, start: int, stop: int) -> dict[str, str]:
        """{name in a stage holding stacked blocks [start, stop): name in the whole model}, e.g. Flux's
        stage (3, 6) of 4 + 2 blocks: transformer_blocks.0 is the model's transformer_blocks.3."""
        names, kept = {}, {}
        for name in self.block_names(model_config)[start:stop]:
            block_list = name.rsplit(".", 1)[0]
            names[f"{block_list}.{kept.setdefault(block_list, 0)}"] = name
            kept[block_list] += 1
        return names

    def block_index(self, key: str, model_config) -> int | None:
        """The stacked index of the block a parameter name belongs to ("single_transformer_blocks.2.x"
        is block num_layers + 2 of Flux), or None outside the blocks."""
        offset = 0
        for name, count in zip(self.block_lists, self.block_counts):
            match = re.match(rf"^{name}\.(\d+)\.", key)
            if match:
                return offset + int(match.group(1))
            offset += model_config.get(count) or 0
        return None

    def stale_kv_layers(self, attention_names, model_config) -> list[int]:
        """Per stacked block, its attention layers whose image K/V a PipeFusion stage keeps from step to step
        (SEQUENCE_PARALLEL_KINDS: self and joint, not cross or text), from the qualified names of the model's
        attention modules (a module's named_modules, or a checkpoint's K projections less ".to_k.weight"): the
        one count the planner, the load's plan and a running stage share."""
        counts = [0] * self.num_blocks(model_config)
        for name in attention_names:
            index = self.block_index(f"{name}.", model_config)
            if index is not None and index < len(counts) and self.attention_kind(name) in SEQUENCE_PARALLEL_KINDS:
                counts[index] += 1
        return counts

    def stale_mixing_layers(self, names, model_config) -> list[tuple[int, int]]:
        """Per stacked block, (its linear-attention layers, its convolving modules): what a PipeFusion stage keeps
        sums and edge rows of, per patch, from the qualified names of the model's modules (a module's named_modules,
        or every prefix of a checkpoint's tensor names)."""
        counts = [[0, 0] for _ in range(self.num_blocks(model_config))]
        convolving = self.row_convolution.module if self.row_convolution else None
        for name in names:
            index = self.block_index(f"{name}.", model_config)
            if index is None or index >= len(counts):
                continue
            counts[index][0] += self.attention_kind(name) == "linear"
            counts[index][1] += bool(convolving and re.search(convolving, name))
        return [tuple(count) for count in counts]

    def blocks(self, transformer) -> list:
        """The model's blocks, every list of them in the forward's order (a stage: those it holds)."""
        return [block for name in self.block_lists for block in getattr(transformer, name)]

    def keep_blocks(self, transformer, start: int, stop: int) -> None:
        """Keep stacked blocks [start, stop) in the model's lists (a list may end up empty)."""
        offset = 0
        for name in self.block_lists:
            blocks = list(getattr(transformer, name))
            first, last = max(start - offset, 0), max(min(stop - offset, len(blocks)), 0)
            setattr(transformer, name, torch.nn.ModuleList(blocks[first:last]))
            offset += len(blocks)
