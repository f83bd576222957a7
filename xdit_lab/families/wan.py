"""Wan 2.1: a T5-family (UMT5) text encoder, video latents [B, C, F, H, W], self-attention over the video's
tokens with the text by cross-attention (which moves nothing), flow matching.

Wan 2.2 TI2V 5B runs text to video (WanPipeline) and image to video (WanImageToVideoPipeline), both with
expand_timesteps: a timestep per token, [B, S], which every rank cuts with its tokens (adapter.PerToken).
Its image to video keeps the image's latents as the first latent frame, whose tokens get timestep 0:

    latents [B, C, F, H, W] --frame 0 replaced by the image's latents--> the model's input
    timestep per token: 0 for frame 0's tokens, t for the others --cut with the tokens--> each rank's

Wan 2.2 A14B's two experts: the pipeline's transformer runs the steps with t >= boundary_ratio × the
scheduler's training timesteps (high noise), transformer_2 the others with guidance_scale_2 (the first
guidance where None). Both are parallelized on the same ranks with the same strategy, each with its own
hooks and state (under PipeFusion each rank holds a stage of each expert's blocks, and each expert warms up
anew at its first step: the session frees the other's stale K/V at the switch).

Wan 2.1's image to video (no expand_timesteps) conditions on the image twice: its latents, with a mask that
marks frame 0 as given, concatenated with the noise on the channels, and CLIP's image embeddings put before
the text in the cross-attention's context (Wan 2.2 A14B's image to video: the channels only, no CLIP):

    [noise 16 | mask 4 | image latents 16] --patch embedding (in_channels 36)--> tokens, cut by the shard
    CLIP(image) [B, 257, 1280] --image embedder--> + text: the cross-attention's keys, whole on every rank

Both are per sample and move nothing under ulysses and ring. Refused by name: a last frame (last_image: Wan
2.1 FLF2V pairs two images' embeddings per sample in the batch dimension, which a cfg or dp split would cut)."""

from __future__ import annotations

import torch

from .adapter import IMAGE_ONLY, VIDEO, FamilyAdapter
from .recipe import VideoRecipe, causal_vae_decoded, video_prompt_embeds
from .tiny_spec import MAX_TOKENS, TEXT_DIM, Part, TinySpec, flow_scheduler, text_parts


def teacache_input(block, argument) -> torch.Tensor:
    """TeaCache's modulated input of a WanTransformerBlock (TeaCache's Wan variant): norm1(hidden_states) ×
    (1 + scale) + shift, the first two of the six modulations the block's scale_shift_table adds to temb, what its
    self-attention takes. temb [B, 6, D], or [B, S, 6, D] with a timestep per token (Wan 2.2 TI2V: this rank's
    tokens' rows)."""
    hidden, temb = argument("hidden_states"), argument("temb")
    per_token = temb.ndim == 4
    table = block.scale_shift_table.unsqueeze(0) if per_token else block.scale_shift_table
    shift, scale = (table + temb.float()).chunk(6, dim=temb.ndim - 2)[:2]
    if per_token:
        shift, scale = shift.squeeze(2), scale.squeeze(2)
    return (block.norm1(hidden.float()) * (1 + scale) + shift).type_as(hidden)


ADAPTER = FamilyAdapter(
    "wan",
    "WanTransformer3DModel",
    shard_at="patch_embedding",
    attention={r"\.attn1$": "self", r"\.attn2$": "cross"},
    latents=VIDEO,
    grid_at_shard=True,
    rotary=IMAGE_ONLY,
    block_lists=("blocks",),
    # from its _cp_plan (cp_plan.py): the rotary tables at rope, and Wan 2.2 TI2V's timestep per token [B, S]
    from_cp_plan=True,
    # tensor parallelism (diffusers declares no _tp_plan for Wan): self and cross attention split by heads, the MLP
    # by its width; the time projection's six modulations [B, 6·dim] split and gathered; the qk RMSNorms span every
    # head (rms_norm_across_heads): computed exactly over the tp ranks
    tp_plan={
        **{f"blocks.*.{attn}.{proj}": "colwise" for attn in ("attn1", "attn2") for proj in ("to_q", "to_k", "to_v")},
        "blocks.*.attn1.to_out.0": "rowwise",
        "blocks.*.attn2.to_out.0": "rowwise",
        "blocks.*.ffn.net.0.proj": "colwise",
        "blocks.*.ffn.net.2": "rowwise",
    },
    tp_gathered=("condition_embedder.time_proj",),
    tp_head_norms=(r"blocks\.\d+\.attn[12]\.norm_[qk]",),
    cache_sigma_pipelines=("WanPipeline",),  # its image to video opens the context without sigma
    teacache=teacache_input,
)


class WanRecipe(VideoRecipe):
    pipeline_classes = ("WanPipeline", "WanImageToVideoPipeline")
    tasks = dict(WanImageToVideoPipeline="image to video")
    output_class = "diffusers.pipelines.wan.pipeline_output:WanPipelineOutput"
    default_size = (480, 832)  # WanPipeline's
    defaults = dict(num_inference_steps=50, guidance_scale=5.0)
    options = dict(
        num_frames=81, max_sequence_length=512, image=None, last_image=None, guidance_scale_2=None
    )  # image: the first frame (image to video)
    # Wan 2.1's image to video: the image's latents and mask (concatenated with the noise), CLIP's embeddings
    image_inputs = (*VideoRecipe.image_inputs, "image_condition", "image_embeds")

    def prompt_tokens(self, pipe, request, text):
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean  # what encode_prompt tokenizes

        return super().prompt_tokens(pipe, request, prompt_clean(text))

    def check_pipeline(self, pipe) -> None:
        two = getattr(pipe, "transformer_2", None) is not None
        if two != (pipe.config.get("boundary_ratio") is not None) or getattr(pipe, "transformer", None) is None:
            raise ValueError(
                f"{type(pipe).__name__} has transformer {'set' if pipe.transformer is not None else 'None'}, "
                f"transformer_2 {'set' if two else 'None'} and boundary_ratio {pipe.config.get('boundary_ratio')}: "
                f"xdit_lab runs one transformer without boundary_ratio, or both experts with it"
            )
        if _image_embeds_taken(pipe) and getattr(pipe, "image_encoder", None) is None:
            raise ValueError(
                f"{type(pipe).__name__}'s transformer takes CLIP image embeddings (image_dim "
                f"{pipe.transformer.config.image_dim}) but the folder has no image_encoder: load a folder with "
                f"its image_encoder and image_processor (Wan 2.1 image to video)"
            )

    def check_inputs(self, pipe, request):
        image = request.options.get("image")
        frames, every = request.options["num_frames"], pipe.vae_scale_factor_temporal
        if frames % every != 1:  # WanPipeline.__call__ rounds it with a logged warning; its prepare_latents does not
            below = frames // every * every + 1 - every if frames > every else None
            fits = [n for n in (below, frames // every * every + 1) if n and n > 0]
            raise ValueError(
                f"num_frames {frames}: Wan's VAE decodes {every}k + 1 frames ({every} frames a latent frame, then the "
                f"first alone); give {' or '.join(map(str, fits))} (diffusers' WanPipeline would round it to "
                f"{frames // every * every + 1} with a warning in its log)"
            )
        if request.options.get("last_image") is not None:
            raise NotImplementedError(
                "a last frame (last_image, Wan 2.1 FLF2V's first-and-last-frame video) is not run by xdit_lab yet: "
                "its two images' CLIP embeddings are paired in the batch dimension, which cfg and dp would cut "
                "apart; give image= alone (image to video)"
            )
        if _image_embeds_taken(pipe) and request.options["max_sequence_length"] != 512:
            raise ValueError(
                f"Wan 2.1's image-to-video transformer takes the last 512 tokens of its context as the text and the "
                f"rest as the image's (diffusers' WanAttnProcessor): max_sequence_length must be 512, not "
                f"{request.options['max_sequence_length']}"
            )
        if _takes_image(pipe) and image is None:
            raise ValueError(f"{type(pipe).__name__} draws a video from an image: give image= (a PIL image)")
        if not _takes_image(pipe) and image is not None:
            raise ValueError(
                f"{type(pipe).__name__} draws from text alone and takes no image; image to video is "
                f"WanImageToVideoPipeline's (load the folder with pipeline_class='WanImageToVideoPipeline')"
            )

    def encode_texts(self, pipe, request, texts, device, *, negative):
        embeds = video_prompt_embeds(pipe, request, texts, device)
        return dict(encoder_hidden_states=embeds.to(pipe.transformer.dtype))

    def prepare(self, pipe, request, prepared, device):
        prepared.extra["guidance_scale_2"] = request.options["guidance_scale_2"]
        pipe.scheduler.set_timesteps(request.num_inference_steps, device=device)
        prepared.timesteps = pipe.scheduler.timesteps
        if not _takes_image(pipe):
            pipe.scheduler.set_begin_index(0)  # WanPipeline's (its image-to-video pipeline does not)
            prepared.latents = self.video_latents(pipe, request, device)
            return
        # WanImageToVideoPipeline's: the noise, and the image's latents as frame 0; with expand_timesteps, the
        # mask that keeps them there (0 on frame 0), else (Wan 2.1) the mask and latents for the channels
        height, width = self.size(request)
        if _image_embeds_taken(pipe):  # CLIP's, of the image as given (one per prompt, the same)
            embeds = pipe.encode_image(request.options["image"], device).repeat(len(request.prompts), 1, 1)
            prepared.extra["image_embeds"] = embeds.to(pipe.transformer.dtype)
        image = pipe.video_processor.preprocess(request.options["image"], height=height, width=width)
        image = image.to(device, dtype=torch.float32)
        prepared_latents = self.video_latents(pipe, request, device, image, channels=pipe.vae.config.z_dim)
        if pipe.config.get("expand_timesteps"):
            prepared.latents, condition, mask = prepared_latents
            prepared.extra["first_frame"] = (condition, mask)
        else:
            prepared.latents, prepared.extra["image_condition"] = prepared_latents

    def transformers(self, pipe):
        return [pipe.transformer] + ([pipe.transformer_2] if getattr(pipe, "transformer_2", None) is not None else [])

    def transformer_for(self, pipe, prepared, t):
        return pipe.transformer if _high_noise(pipe, t) else pipe.transformer_2

    def guidance_at(self, pipe, prepared, step_index):
        low_noise = not _high_noise(pipe, prepared.timesteps[step_index])  # its own scale, where given
        if low_noise and prepared.extra["guidance_scale_2"] is not None:
            return prepared.extra["guidance_scale_2"]
        return prepared.guidance_scale

    def model_input(self, pipe, prepared, latents, t):
        condition = prepared.extra.get("image_condition")  # Wan 2.1's image to video: on the channels
        if condition is not None:
            latents = torch.cat([latents, condition[: len(latents)]], dim=1)
        return super().model_input(pipe, prepared, _with_first_frame(prepared, latents), t)

    def model_kwargs(self, pipe, prepared, model_input, t):
        kwargs = super().model_kwargs(pipe, prepared, model_input, t)
        embeds = prepared.extra.get("image_embeds")
        if embeds is not None:  # the same for both branches (the pipeline passes them to both calls)
            kwargs["encoder_hidden_states_image"] = embeds.repeat(model_input.shape[0] // len(embeds), 1, 1)
        if pipe.config.get("expand_timesteps"):  # Wan 2.2 TI2V: its pipelines' timestep per token, [B, S]
            # (the first-frame mask, or ones, over the latent grid, strided by the 2 × 2 patch they assume, times t)
            first_frame = prepared.extra.get("first_frame")
            if first_frame is not None:
                mask = first_frame[1][0][0]
            else:
                mask = torch.ones(model_input.shape[2:], dtype=torch.float32, device=model_input.device)
            per_token = (mask[:, ::2, ::2] * t).flatten()
            kwargs["timestep"] = per_token.unsqueeze(0).expand(model_input.shape[0], -1)
        return kwargs

    def decode(self, pipe, prepared, latents, output_type):
        return super().decode(pipe, prepared, _with_first_frame(prepared, latents), output_type)

    def planned_text_bytes(self, transformer, call, element):
        return call.options["max_sequence_length"] * transformer["text_dim"] * element  # UMT5's states

    def decoded(self, pipe, prepared, latents):
        return causal_vae_decoded(pipe, latents)


RECIPE = WanRecipe()


def _high_noise(pipe, t) -> bool:
    """Whether the first expert runs at `t`: always with one transformer (WanPipeline's boundary_timestep)."""
    ratio = pipe.config.get("boundary_ratio")
    return ratio is None or t >= ratio * pipe.scheduler.config.num_train_timesteps


def _takes_image(pipe) -> bool:
    return type(pipe).__name__ == "WanImageToVideoPipeline"


def _image_embeds_taken(pipe) -> bool:
    """Whether the pipeline feeds its transformer CLIP image embeddings (Wan 2.1's image to video only)."""
    return _takes_image(pipe) and pipe.transformer is not None and pipe.transformer.config.image_dim is not None


def _with_first_frame(prepared, latents):
    """Image to video: the latents with frame 0 the image's, as the pipeline feeds and returns them."""
    first_frame = prepared.extra.get("first_frame")
    if first_frame is None:
        return latents
    condition, mask = first_frame
    return (1 - mask) * condition[: len(latents)] + mask * latents


def tiny_inputs(batch, height, width, text, timestep, randn):  # two latent frames
    return dict(hidden_states=randn(batch, 4, 2, height, width), encoder_hidden_states=text, timestep=timestep.long())


TINY = TinySpec(  # modelled on diffusers' own test of WanTransformer3DModel
    transformer=dict(
        patch_size=(1, 2, 2), in_channels=4, out_channels=4, text_dim=TEXT_DIM, freq_dim=32, ffn_dim=32,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    ),
    inputs=tiny_inputs,
    pipeline_classes=("WanPipeline",),
    parts=dict(  # Wan 2.1's layout: one transformer, flow matching with shift
        **text_parts("t5", seed=1, umt5=True),
        vae=Part("wan_vae", seed=2, kwargs=dict(latent_channels=4)),
        scheduler=flow_scheduler(shift=3.0),
    ),
    # 5 frames -> 2 latent frames of 8 × 8
    call=dict(height=64, width=64, num_frames=5, max_sequence_length=MAX_TOKENS),
)  # fmt: skip
