"""One small adapter per diffusers DiT family: where tokens are sharded and gathered, where
text sits, what kind each attention module is, and how its blocks are stacked. No forward is
copied: diffusers' model runs unchanged and hooks.py takes over at the places named here.

Attention kinds (matched on the module's qualified name):
    self        image tokens only: sequence-parallel
    cross       image queries, text keys/values (PixArt): local, no communication
    joint_first text tokens before image tokens in q/k/v (Flux, Flux.2, CogVideoX, Qwen-Image,
                whose padded text keys are masked)
    joint_last  text tokens after image tokens (SD3, HunyuanVideo, whose padded text keys are masked)
    text        text tokens alone (HunyuanVideo's token refiner): whole on every rank, runs as it is
Wan's cross-attention (text, and for image-to-video the image context) is cross: it moves nothing.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

import torch

SUPPORTED_DIFFUSERS = ("0.42", "0.43")  # tested range: >= first, < second


@dataclass(frozen=True)
class FamilyAdapter:
    family: str
    class_name: str
    shard_at: str  # submodule whose output holds the whole image tokens [B, S, C] (positions added)
    gather_at: str  # submodule whose output holds this rank's tokens, before unpatchify
    attention: dict = field(default_factory=dict)  # qualified-name regex -> kind
    text_before_image_at_shard: bool = False  # CogVideoX embeds [text; image] in one tensor
    grid_at_shard: bool = False  # Wan: shard_at gives [B, C, F, H, W]; its tokens are the flattened grid
    rotary_at: str | None = None  # the submodule whose output holds rotary tables, laid out as:
    # "text_then_image": rows for [text; image], a table or (cos, sin) (Flux)
    # "image": (cos, sin) of image tokens only, [1, S, 1, D] (Wan) or [S, D] (HunyuanVideo)
    # "image_and_text": (image rows [S, D], text rows [T, D]) (Qwen-Image)
    rotary_layout: str = "text_then_image"
    text_key_mask: bool = False  # joint attention masks padded text keys, [B, 1, 1, T + S] bool (Qwen-Image)
    image_rows_kwarg: str | None = None  # a forward argument with one row per image token (dim -2):
    # CogVideoX's rotary tables (a tuple), Flux.2's img_ids
    per_token_config: tuple = ()  # model config "key" (set) or "key=value" entries that condition each image
    # token by an index the forward builds whole (Qwen-Image-Edit's zero_cond_t, HunyuanVideo I2V's token
    # replace): no strategy can split its tokens yet
    unbatched: tuple = ()  # forward arguments without a batch dimension
    not_batched_dicts: tuple = ("joint_attention_kwargs", "attention_kwargs", "cross_attention_kwargs")
    # why StepCache is not offered, or None: it is offered where it is checked against diffusers' First-Block Cache
    step_cache_refused: str | None = None
    # PipeFusion cuts the blocks of these lists, concatenated in the forward's order, into stages
    block_lists: tuple = ("transformer_blocks",)
    block_counts: tuple = ("num_layers",)  # the config key holding each list's length
    joined_block_lists: tuple = ()  # lists whose blocks take [text; image] as one tensor (Flux.2's single-stream)
    # hidden_states: "image" [B, C, H, W], "tokens" [B, S, C], "frames" [B, F, C, H, W], "video" [B, C, F, H, W]
    latent_layout: str = "image"

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

    def token_grid(self, latents, model_config, arguments) -> tuple[int, int]:
        """(rows, cols) of the image tokens in the order the model holds them; PipeFusion cuts its
        patches as bands of rows. Packed tokens (Flux) carry their grid in img_ids (row, column in
        columns 1 and 2): reading it is a host sync, so call this once per latent size."""
        patch = model_config.get("patch_size") or 1
        if self.latent_layout == "tokens" and "img_shapes" in arguments:  # Qwen-Image: [(frames, rows, cols)]
            images = arguments["img_shapes"][0]  # per sample; diffusers' rotary reads the first
            images = images if isinstance(images, list) else [images]
            if len(images) != 1:
                raise NotImplementedError(
                    f"{len(images)} images per sample (an edit's reference images) do not form one grid of rows; "
                    f"PipeFusion cuts one image into row bands: run it without PipeFusion"
                )
            frames, rows, cols = images[0]
            return frames * rows, cols
        if self.latent_layout == "tokens":
            ids = arguments["img_ids"]
            cols = int(ids.reshape(-1, ids.shape[-1])[:, 2].max()) + 1
            return latents.shape[1] // cols, cols
        if self.latent_layout == "video":  # Wan, HunyuanVideo: [B, C, F, H, W], patches (t, h, w); frame-major
            (pt, ph, pw), (frames, height, width) = self.video_patch(model_config), latents.shape[-3:]
            return frames // pt * (height // ph), width // pw
        rows = latents.shape[-2] // patch
        if self.latent_layout == "frames":  # CogVideoX: frame-major, then rows
            patch_t = model_config.get("patch_size_t") or 1
            rows *= -(-latents.shape[1] // patch_t)
        return rows, latents.shape[-1] // patch

    def latent_positions(self, latents, model_config) -> torch.Tensor:
        """[S, X]: for each image token, in the model's order, the flat positions in one sample of
        `latents` that it is made of. PipeFusion's async schedule steps the scheduler patch by patch
        and sends a patch's latents back to stage 0: these are that patch's elements."""
        shape, patch = latents.shape[1:], model_config.get("patch_size") or 1
        flat = torch.arange(shape.numel(), device=latents.device)
        if self.latent_layout == "tokens":  # [S, C]: a token is a row
            return flat.view(shape)
        if self.latent_layout == "image":  # [C, H, W], p × p pixels a token
            c, h, w = shape
            return (
                flat.view(c, h // patch, patch, w // patch, patch).permute(1, 3, 0, 2, 4).reshape(h * w // patch**2, -1)
            )
        if self.latent_layout == "frames":  # CogVideoX [F, C, H, W]: frame-major, p × p (× patch_size_t frames)
            f, c, h, w = shape
            pt = model_config.get("patch_size_t") or 1
            if f % pt:
                raise NotImplementedError(f"{f} latent frames do not divide by patch_size_t {pt}")
            grouped = flat.view(f // pt, pt, c, h // patch, patch, w // patch, patch)
            return grouped.permute(0, 3, 5, 1, 2, 4, 6).reshape(f // pt * (h // patch) * (w // patch), -1)
        c, f, h, w = shape  # "video", Wan and HunyuanVideo [C, F, H, W] with patches (t, h, w)
        pt, ph, pw = self.video_patch(model_config)
        grouped = flat.view(c, f // pt, pt, h // ph, ph, w // pw, pw)
        return grouped.permute(1, 3, 5, 0, 2, 4, 6).reshape(f // pt * (h // ph) * (w // pw), -1)

    @staticmethod
    def video_patch(model_config) -> tuple[int, int, int]:
        """(frames, rows, cols) of a video token: Wan's patch_size tuple, or HunyuanVideo's patch_size and
        patch_size_t."""
        patch = model_config.get("patch_size")
        if isinstance(patch, (tuple, list)):
            return tuple(patch)
        return model_config.get("patch_size_t") or 1, patch, patch

    def per_token_settings(self, model_config) -> list[str]:
        """The per_token_config entries this model's config sets."""
        found = []
        for entry in self.per_token_config:
            key, _, value = entry.partition("=")
            if (model_config.get(key) == value) if value else model_config.get(key):
                found.append(entry)
        return found

    def keep_rotary_rows(self, tables, text: int, keep):
        """The rotary tables of the image tokens a rank holds, and every text row. `keep(t, dim)`
        keeps the rank's image rows of t along dim (a contiguous shard, or a stage's active patches)."""
        if self.rotary_layout == "image":
            return tuple(keep(t, 1 if t.dim() == 4 else 0) for t in tables)
        if self.rotary_layout == "image_and_text":
            image, text_rows = tables
            return keep(image, 0), text_rows

        def rows(t):
            return torch.cat([t[:text], keep(t[text:], 0)], dim=0)

        return tuple(rows(t) for t in tables) if isinstance(tables, tuple) else rows(tables)

    def patch_grid(self, grid: tuple[int, int]) -> tuple[int, int] | None:
        """The (rows, cols) PipeFusion cuts into patches, for an image of grid[0] × grid[1] tokens; None
        for a video, whose frames stack more rows than one image has."""
        return None if self.latent_layout in ("frames", "video") else grid

    def prediction_shape(self, latents, model_config) -> tuple[int, ...]:
        """The shape of the model's output for `latents`: the latents with the output channels."""
        channels = model_config.get("out_channels") or model_config.get("in_channels")
        if self.latent_layout == "tokens":  # packed: a token carries its patch's pixels (Qwen-Image's 2 × 2)
            channels *= (model_config.get("patch_size") or 1) ** 2
        dim = {"image": 1, "tokens": 2, "frames": 2, "video": 1}[self.latent_layout]
        return (*latents.shape[:dim], channels, *latents.shape[dim + 1 :])


def block_metadata(block):
    """Where a block returns its image and text states: diffusers' own declaration of its blocks."""
    from diffusers.hooks._helpers import TransformerBlockRegistry

    try:
        return TransformerBlockRegistry.get(type(block))
    except ValueError:
        raise TypeError(
            f"xdit_lab does not know where {type(block).__name__} returns its hidden states "
            f"(diffusers' TransformerBlockRegistry has no entry for it)"
        ) from None


FAMILIES = {
    adapter.class_name: adapter
    for adapter in (
        FamilyAdapter(
            "PixArt",
            "PixArtTransformer2DModel",
            shard_at="pos_embed",
            gather_at="proj_out",
            attention={r"\.attn1$": "self", r"\.attn2$": "cross"},
        ),
        FamilyAdapter(
            "SD3",
            "SD3Transformer2DModel",
            shard_at="pos_embed",
            gather_at="proj_out",
            attention={r"^transformer_blocks\.\d+\.attn$": "joint_last", r"\.attn2$": "self"},
        ),
        FamilyAdapter(
            "Flux",
            "FluxTransformer2DModel",
            shard_at="x_embedder",
            gather_at="proj_out",
            attention={
                r"^transformer_blocks\.\d+\.attn$": "joint_first",
                r"^single_transformer_blocks\.\d+\.attn$": "joint_first",
            },
            rotary_at="pos_embed",
            unbatched=("img_ids", "txt_ids"),
            block_lists=("transformer_blocks", "single_transformer_blocks"),
            block_counts=("num_layers", "num_single_layers"),
            latent_layout="tokens",
        ),
        FamilyAdapter(
            "Flux.2",
            "Flux2Transformer2DModel",
            shard_at="x_embedder",
            gather_at="proj_out",
            attention={
                r"^transformer_blocks\.\d+\.attn$": "joint_first",
                r"^single_transformer_blocks\.\d+\.attn$": "joint_first",
            },
            image_rows_kwarg="img_ids",  # its rotary tables are computed from them, text ids apart
            unbatched=("img_ids", "txt_ids"),
            block_lists=("transformer_blocks", "single_transformer_blocks"),
            block_counts=("num_layers", "num_single_layers"),
            joined_block_lists=("single_transformer_blocks",),
            latent_layout="tokens",
            step_cache_refused="diffusers' First-Block Cache, the reference it is checked against, raises on it",
        ),
        FamilyAdapter(
            "Qwen-Image",
            "QwenImageTransformer2DModel",
            shard_at="img_in",
            gather_at="proj_out",
            attention={r"^transformer_blocks\.\d+\.attn$": "joint_first"},
            rotary_at="pos_embed",
            rotary_layout="image_and_text",
            text_key_mask=True,
            per_token_config=("zero_cond_t",),
            latent_layout="tokens",
        ),
        FamilyAdapter(
            "HunyuanVideo",
            "HunyuanVideoTransformer3DModel",
            shard_at="x_embedder",
            gather_at="proj_out",
            attention={
                r"^transformer_blocks\.\d+\.attn$": "joint_last",
                r"^single_transformer_blocks\.\d+\.attn$": "joint_last",  # [image; text] joined in the processor
                r"^context_embedder\.token_refiner\.refiner_blocks\.\d+\.attn$": "text",
            },
            rotary_at="rope",  # computed from the latents, before the tokens are sharded
            rotary_layout="image",
            text_key_mask=True,
            per_token_config=("image_condition_type=token_replace",),
            block_lists=("transformer_blocks", "single_transformer_blocks"),
            block_counts=("num_layers", "num_single_layers"),
            latent_layout="video",
        ),
        FamilyAdapter(
            "CogVideoX",
            "CogVideoXTransformer3DModel",
            shard_at="patch_embed",
            gather_at="proj_out",
            attention={r"\.attn1$": "joint_first"},
            text_before_image_at_shard=True,
            image_rows_kwarg="image_rotary_emb",
            unbatched=("image_rotary_emb",),
            latent_layout="frames",
        ),
        FamilyAdapter(
            "Wan",
            "WanTransformer3DModel",
            shard_at="patch_embedding",
            gather_at="proj_out",
            attention={r"\.attn1$": "self", r"\.attn2$": "cross"},
            grid_at_shard=True,
            rotary_at="rope",
            rotary_layout="image",
            block_lists=("blocks",),
            latent_layout="video",
        ),
        FamilyAdapter(
            "DiT",
            "DiTTransformer2DModel",
            shard_at="pos_embed",
            gather_at="proj_out_2",
            attention={r"\.attn1$": "self"},
        ),
    )
}


def block_index(transformer_config: dict, key: str) -> int | None:
    """The stacked block index of a tensor name in a transformer folder (None outside the blocks, or
    for a class xdit_lab does not parallelize): Flux's double-stream blocks, then its single ones."""
    adapter = FAMILIES.get(transformer_config.get("_class_name"))
    return adapter.block_index(key, transformer_config) if adapter else None


def adapter_named(family: str) -> FamilyAdapter:
    """The adapter of a family by its short name ("PixArt", "Flux", ...)."""
    for adapter in FAMILIES.values():
        if adapter.family == family:
            return adapter
    raise KeyError(f"no family {family!r}; families: {', '.join(a.family for a in FAMILIES.values())}")


def adapter_for(transformer) -> FamilyAdapter:
    """The family adapter of a transformer, found through its class's MRO: FSDP2's fully_shard swaps the
    class for a subclass (FSDPFluxTransformer2DModel), whose base is still the family's class."""
    for cls in type(transformer).__mro__:
        if cls.__name__ in FAMILIES:
            return FAMILIES[cls.__name__]
    name = type(transformer).__name__
    raise TypeError(f"xdit_lab cannot parallelize {name}; supported transformers: {', '.join(FAMILIES)}")


@functools.cache
def check_diffusers_version(version: str | None = None) -> None:
    """Raise when the installed diffusers is outside the range these adapters were tested on
    (checked once per process and version)."""
    from packaging.version import Version

    if version is None:
        import diffusers

        version = diffusers.__version__
    low, high = SUPPORTED_DIFFUSERS
    if not Version(low) <= Version(version) < Version(high):
        raise RuntimeError(
            f"diffusers {version} is installed, but xdit_lab's model adapters support diffusers >= {low}, < {high} "
            f"(module names and attention layouts change between releases). "
            f"Install a supported release: pip install 'diffusers>={low},<{high}'"
        )


def output_conditioning_from_block_0(transformer, block_0) -> None:
    """DiT's output layer takes its conditioning from `transformer_blocks[0].norm1.emb`, the model's
    block 0. On a later stage that list starts at another block, so once this stage's blocks have
    run, that call is answered by block 0's embedding, kept here (a few small layers). The hooks
    hold that embedding, not the transformer: no reference cycle keeps a replaced model alive."""
    block_0_emb = block_0.norm1.emb
    transformer._xdit_lab_block_0_emb = block_0_emb  # a registered submodule: moves with the model
    first, last = transformer.transformer_blocks[0], transformer.transformer_blocks[-1]
    blocks_done = [False]

    def entering(_module, _args):
        blocks_done[0] = False

    def leaving(_module, _args, _output):
        blocks_done[0] = True

    def output_conditioning(_module, args, kwargs, output):
        return block_0_emb(*args, **kwargs) if blocks_done[0] else output

    first.register_forward_pre_hook(entering)
    last.register_forward_hook(leaving)
    first.norm1.emb.register_forward_hook(output_conditioning, with_kwargs=True)
