"""CogVideoX: T5 text, video latents [B, F, C, H, W], joint attention with the text first (embedded with
the video in one tensor), rotary tables per image token passed to the forward, DDIM or DPM schedulers."""

from __future__ import annotations

import torch

from .adapter import FRAMES, FamilyAdapter, PerToken
from .recipe import Recipe, RequestShape, generator_of, latent_frames, vae_scale, video_prompt_embeds
from .tiny_spec import MAX_TOKENS, TEXT_DIM, Part, TinySpec, text_parts


def teacache_input(block, argument) -> torch.Tensor:
    """TeaCache's modulated input of a CogVideoXBlock: its norm1 (CogVideoXLayerNormZero) of the image and text
    states at temb, the image's part, what its attention takes with the text's."""
    return block.norm1(argument("hidden_states"), argument("encoder_hidden_states"), argument("temb"))[0]


ADAPTER = FamilyAdapter(
    "cogvideox",
    "CogVideoXTransformer3DModel",
    shard_at="patch_embed",
    attention={r"\.attn1$": "joint_first"},
    latents=FRAMES,
    text_before_image_at_shard=True,
    per_token=(PerToken("", "image_rotary_emb", dim=-2),),  # rotary (cos, sin), a row per image token
    unbatched=("image_rotary_emb",),
    # tensor parallelism (diffusers declares no _tp_plan for CogVideoX): attention split by heads (its qk
    # LayerNorms are per head), the MLP by width, both over [text; image] joined; the two modulations a block
    # [B, 6·dim] and the output's split and gathered
    tp_plan={
        **{f"transformer_blocks.*.attn1.{p}": "colwise" for p in ("to_q", "to_k", "to_v")},
        "transformer_blocks.*.attn1.to_out.0": "rowwise",
        "transformer_blocks.*.ff.net.0.proj": "colwise",
        "transformer_blocks.*.ff.net.2": "rowwise",
    },
    tp_gathered=("transformer_blocks.*.norm1.linear", "transformer_blocks.*.norm2.linear", "norm_out.linear"),
    tp_tokens={r"transformer_blocks\.\d+\.(attn1\.to_out\.0|ff\.net\.2)": "joint"},
    teacache=teacache_input,
)


class CogVideoXRecipe(Recipe):
    pipeline_classes = ("CogVideoXPipeline",)
    output_class = "diffusers.pipelines.cogvideo.pipeline_output:CogVideoXPipelineOutput"
    output_field = "frames"
    defaults = dict(num_inference_steps=50, guidance_scale=6.0)
    options = dict(num_frames=None, eta=0.0, max_sequence_length=226)
    cfg_in_one_call = True  # its pipeline's cache_context("cond_uncond")

    def text_cap(self, pipe):
        return pipe.transformer.config.max_text_seq_length  # the text positions its patch embedding has

    def size_multiple(self, pipe):
        config = pipe.transformer.config
        scale = pipe.vae_scale_factor_spatial
        return scale * config.patch_size, (config.sample_height * scale, config.sample_width * scale)

    def token_frames(self, pipe, request):
        config = pipe.transformer.config
        frames = request.options.get("num_frames") or config.sample_frames
        latent_frames = (frames - 1) // pipe.vae_scale_factor_temporal + 1
        return -(-latent_frames // (config.patch_size_t or 1))

    def encode_texts(self, pipe, request, texts, device, *, negative):
        embeds = video_prompt_embeds(pipe, request, texts, device)
        return dict(encoder_hidden_states=embeds)

    def planned_request(self, configs, call, element):
        t = configs["transformer"]
        scale = vae_scale(configs["vae"])[0]
        frames = latent_frames(configs, call)
        patch_t = t.get("patch_size_t") or 1
        frames += -frames % patch_t  # CogVideoX 1.5 pads the latent frames to its temporal patch
        rows, cols = call.height // scale, call.width // scale
        latents = frames * t["in_channels"] * rows * cols * element
        per_row = call.options["max_sequence_length"] * t["text_embed_dim"] * element
        patch = t["patch_size"]
        grid = (frames // patch_t * (rows // patch), cols // patch)
        shared = 0
        if t.get("use_rotary_positional_embeddings"):  # (cos, sin) [tokens, head_dim], float32
            shared = 2 * grid[0] * grid[1] * t["attention_head_dim"] * 4
        return RequestShape(latents, per_row, shared, grid, None, frames)

    def planned_default_size(self, configs):
        t, scale = configs["transformer"], vae_scale(configs["vae"])[0]
        return t["sample_height"] * scale, t["sample_width"] * scale

    def planned_option_defaults(self, configs):
        return {"num_frames": configs["transformer"]["sample_frames"]}

    def prepare(self, pipe, request, prepared, device):
        from diffusers.pipelines.cogvideo.pipeline_cogvideox import retrieve_timesteps

        config = pipe.transformer.config
        height = request.height or config.sample_height * pipe.vae_scale_factor_spatial
        width = request.width or config.sample_width * pipe.vae_scale_factor_spatial
        frames = request.options["num_frames"] or config.sample_frames
        latent_frames = (frames - 1) // pipe.vae_scale_factor_temporal + 1
        extra_frames = 0
        if config.patch_size_t is not None and latent_frames % config.patch_size_t:
            extra_frames = config.patch_size_t - latent_frames % config.patch_size_t
            frames += extra_frames * pipe.vae_scale_factor_temporal
        generator = generator_of(request)
        prepared.timesteps, _ = retrieve_timesteps(pipe.scheduler, request.num_inference_steps, device)
        embeds = prepared.conditioning["encoder_hidden_states"]
        prepared.latents = pipe.prepare_latents(
            len(request.prompts), config.in_channels, frames, height, width, embeds.dtype, device, generator, None
        )
        prepared.extra.update(
            step_kwargs=pipe.prepare_extra_step_kwargs(generator, request.options["eta"]),
            extra_frames=extra_frames,
            dtype=embeds.dtype,
            old_pred_original_sample=None,
        )
        if config.use_rotary_positional_embeddings:
            prepared.conditioning["image_rotary_emb"] = pipe._prepare_rotary_positional_embeddings(
                height, width, prepared.latents.size(1), device
            )

    def guide(self, pipe, prepared, noise, step_index):
        return super().guide(pipe, prepared, noise.float(), step_index)

    def scheduler_step(self, pipe, prepared, noise, t, latents, step_index):
        from diffusers import CogVideoXDPMScheduler

        step_kwargs = prepared.extra["step_kwargs"]
        if not isinstance(pipe.scheduler, CogVideoXDPMScheduler):
            latents = pipe.scheduler.step(noise, t, latents, **step_kwargs, return_dict=False)[0]
        else:  # a multistep scheduler: it carries the previous prediction from step to step
            previous_t = prepared.timesteps[step_index - 1] if step_index > 0 else None
            latents, prepared.extra["old_pred_original_sample"] = pipe.scheduler.step(
                noise,
                prepared.extra["old_pred_original_sample"],
                t,
                previous_t,
                latents,
                **step_kwargs,
                return_dict=False,
            )
        return latents.to(prepared.extra["dtype"])

    def decoded(self, pipe, prepared, latents):
        return pipe.decode_latents(latents[:, prepared.extra["extra_frames"] :])  # the padded frames dropped


RECIPE = CogVideoXRecipe()


def tiny_inputs(batch, height, width, text, timestep, randn):
    return dict(hidden_states=randn(batch, 3, 4, height, width), encoder_hidden_states=text, timestep=timestep.long())


TINY = TinySpec(
    transformer=dict(
        in_channels=4, out_channels=4, patch_size=2, time_embed_dim=32, text_embed_dim=TEXT_DIM,
        max_text_seq_length=8, sample_width=8, sample_height=8, sample_frames=9, temporal_compression_ratio=4,
    ),
    inputs=tiny_inputs,
    pipeline_classes=("CogVideoXPipeline",),
    parts=dict(
        **text_parts("t5", seed=1),
        vae=Part("video_vae", seed=2),
        scheduler=Part(  # CogVideoX-2b's sampler: v-prediction, zero-SNR, trailing
            "CogVideoXDDIMScheduler",
            kwargs=dict(
                clip_sample=False, prediction_type="v_prediction", rescale_betas_zero_snr=True,
                timestep_spacing="trailing",
            ),
        ),
    ),
    call=dict(height=32, width=32, num_frames=9, max_sequence_length=MAX_TOKENS),  # 9 frames -> 3 latent frames
)  # fmt: skip
