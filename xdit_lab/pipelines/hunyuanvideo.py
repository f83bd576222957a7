"""HunyuanVideo: Llama states (padded to max_sequence_length, masked) and CLIP's pooled embedding,
video latents [B, C, F, H, W], joint attention with the text after the image, guidance-distilled,
flow matching.

diffusers' HunyuanVideoPipeline runs the negative prompt as a second forward (true CFG, when
true_cfg_scale > 1 and a negative prompt is given); here both go in one batch [negative; positive],
which cfg 2 then splits. Every prompt's text is padded to the same max_sequence_length, so the
branches and the ranks' rows stack as they are."""

from __future__ import annotations

import numpy as np
import torch
from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE, retrieve_timesteps
from diffusers.pipelines.hunyuan_video.pipeline_output import HunyuanVideoPipelineOutput

from .base import TrueCFGRecipe, video_latents


class HunyuanVideoRecipe(TrueCFGRecipe):
    family = "HunyuanVideo"
    pipeline_classes = ("HunyuanVideoPipeline",)
    output_class = HunyuanVideoPipelineOutput
    defaults = dict(num_inference_steps=50, guidance_scale=6.0)  # the distilled guidance, an input
    options = dict(true_cfg_scale=1.0, num_frames=129, max_sequence_length=256, prompt_template=DEFAULT_PROMPT_TEMPLATE)

    def size_multiple(self, pipe):
        return pipe.vae_scale_factor_spatial * pipe.transformer.config.patch_size, (720, 1280)  # the default size

    def default_latent_side(self, transformer_config):
        return None  # a video: the 2D decode plan does not apply

    def token_frames(self, pipe, request):
        frames = (request.options["num_frames"] - 1) // pipe.vae_scale_factor_temporal + 1
        return frames // pipe.transformer.config.patch_size_t

    def encode_texts(self, pipe, request, texts, device, *, negative):
        embeds, pooled, mask = pipe.encode_prompt(
            prompt=texts,
            prompt_template=request.options["prompt_template"],
            device=device,
            max_sequence_length=request.options["max_sequence_length"],
        )
        dtype = pipe.transformer.dtype
        return dict(
            encoder_hidden_states=embeds.to(dtype),
            encoder_attention_mask=mask.to(dtype),
            pooled_projections=pooled.to(dtype),
        )

    def prepare(self, pipe, request, prepared, device):
        default_height, default_width = self.size_multiple(pipe)[1]
        height, width = request.height or default_height, request.width or default_width
        steps = request.num_inference_steps
        sigmas = np.linspace(1.0, 0.0, steps + 1)[:-1]
        prepared.timesteps, _ = retrieve_timesteps(pipe.scheduler, steps, device, sigmas=sigmas)
        pipe.scheduler.set_begin_index(0)
        prepared.latents = video_latents(pipe, request, height, width, device)

    def scale_model_input(self, pipe, model_input, t):
        return model_input.to(pipe.transformer.dtype)  # flow matching feeds latents as they are

    def model_kwargs(self, pipe, prepared, model_input, t):
        rows, dtype = model_input.shape[0], pipe.transformer.dtype
        guidance = torch.full([rows], prepared.extra["distilled_guidance"], dtype=dtype, device=model_input.device)
        return dict(
            hidden_states=model_input,
            timestep=t.expand(rows).to(torch.float32),
            guidance=guidance * 1000.0,
            return_dict=False,
            **prepared.conditioning,
        )

    def decode(self, pipe, prepared, latents, output_type):
        if output_type == "latent":
            return latents
        video = pipe.vae.decode(latents.to(pipe.vae.dtype) / pipe.vae.config.scaling_factor, return_dict=False)[0]
        return pipe.video_processor.postprocess_video(video, output_type=output_type)

    def wrap_output(self, images):
        return self.output_class(frames=images)
