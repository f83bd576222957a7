"""Wan 2.1 (and Wan 2.2 with one transformer): a T5-family text encoder, video latents
[B, C, F, H, W], self-attention over the video's tokens with text by cross-attention, flow matching.

Wan 2.2's two-expert pipelines (boundary_ratio: a second transformer for the low-noise steps) and
its timestep per token (expand_timesteps, TI2V) are refused by name: the second transformer is not
parallelized here, and a per-token timestep cannot be split with the tokens yet."""

from __future__ import annotations

import torch
from diffusers.pipelines.wan.pipeline_output import WanPipelineOutput

from .base import Recipe, video_latents, video_prompt_embeds


class WanRecipe(Recipe):
    family = "Wan"
    pipeline_classes = ("WanPipeline",)
    output_class = WanPipelineOutput
    defaults = dict(num_inference_steps=50, guidance_scale=5.0)
    options = dict(num_frames=81, max_sequence_length=512)

    def check_pipeline(self, pipe) -> None:
        if pipe.config.get("boundary_ratio") is not None or getattr(pipe, "transformer_2", None) is not None:
            raise NotImplementedError(
                "Wan 2.2's two-expert pipeline (boundary_ratio, transformer_2) is not run by xdit_lab yet: only its "
                "first transformer would be parallelized; use a single-transformer Wan pipeline (Wan 2.1, Wan 2.2 5B)"
            )
        if pipe.config.get("expand_timesteps"):
            raise NotImplementedError(
                "this Wan pipeline uses a timestep per token (expand_timesteps), which xdit_lab cannot split with the "
                "tokens yet; run a Wan pipeline with one timestep per sample"
            )

    def size_multiple(self, pipe):
        patch = pipe.transformer.config.patch_size  # (frames, rows, cols)
        return pipe.vae_scale_factor_spatial * patch[1], (480, 832)  # WanPipeline's default size

    def default_latent_side(self, transformer_config):
        return None  # a video: the 2D decode plan does not apply

    def token_frames(self, pipe, request):
        frames = (request.options["num_frames"] - 1) // pipe.vae_scale_factor_temporal + 1
        return frames // pipe.transformer.config.patch_size[0]

    def encode_texts(self, pipe, request, texts, device, *, negative):
        embeds = video_prompt_embeds(pipe, request, texts, device)
        return dict(encoder_hidden_states=embeds.to(pipe.transformer.dtype))

    def prepare(self, pipe, request, prepared, device):
        default_height, default_width = self.size_multiple(pipe)[1]
        height, width = request.height or default_height, request.width or default_width
        pipe.scheduler.set_timesteps(request.num_inference_steps, device=device)
        pipe.scheduler.set_begin_index(0)
        prepared.timesteps = pipe.scheduler.timesteps
        prepared.latents = video_latents(pipe, request, height, width, device)

    def scale_model_input(self, pipe, model_input, t):
        return model_input.to(pipe.transformer.dtype)  # flow matching feeds latents as they are

    def decode(self, pipe, prepared, latents, output_type):
        if output_type == "latent":
            return latents
        config = pipe.vae.config
        latents = latents.to(pipe.vae.dtype)
        mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(latents)
        std = torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(latents)
        video = pipe.vae.decode(latents * std + mean, return_dict=False)[0]
        return pipe.video_processor.postprocess_video(video, output_type=output_type)

    def wrap_output(self, images):
        return self.output_class(frames=images)
