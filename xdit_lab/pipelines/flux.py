"""Flux.1: CLIP pooled + T5 text, packed 2×2 latent tokens, guidance embedding, true CFG optional.

diffusers' FluxPipeline runs the negative prompt as a second forward (true CFG, when
true_cfg_scale > 1 and a negative prompt is given); here both go in one batch
[negative; positive], which cfg 2 then splits over two ranks."""

from __future__ import annotations

import numpy as np
import torch
from diffusers.pipelines.flux.pipeline_flux import calculate_shift, retrieve_timesteps
from diffusers.pipelines.flux.pipeline_output import FluxPipelineOutput

from .base import TrueCFGRecipe, generator_of


class FluxRecipe(TrueCFGRecipe):
    family = "Flux"
    pipeline_classes = ("FluxPipeline",)
    output_class = FluxPipelineOutput
    defaults = dict(num_inference_steps=28, guidance_scale=3.5)
    options = dict(true_cfg_scale=1.0, max_sequence_length=512)

    def size_multiple(self, pipe):
        default = pipe.default_sample_size * pipe.vae_scale_factor
        return pipe.vae_scale_factor * 2, (default, default)  # latents are packed in 2×2 patches

    def default_latent_side(self, transformer_config):
        return 128  # FluxPipeline's default_sample_size (not in the transformer's config)

    unbatched_conditioning = ("txt_ids",)

    def encode_texts(self, pipe, request, texts, device, *, negative):
        embeds, pooled, text_ids = pipe.encode_prompt(
            prompt=texts,
            prompt_2=None,
            device=device,
            num_images_per_prompt=1,
            max_sequence_length=request.options["max_sequence_length"],
        )
        return dict(encoder_hidden_states=embeds, pooled_projections=pooled, txt_ids=text_ids)

    def prepare(self, pipe, request, prepared, device):
        height = request.height or pipe.default_sample_size * pipe.vae_scale_factor
        width = request.width or pipe.default_sample_size * pipe.vae_scale_factor
        prepared.extra["size"] = (height, width)
        embeds = prepared.conditioning["encoder_hidden_states"]
        prepared.latents, image_ids = pipe.prepare_latents(
            len(request.prompts),
            pipe.transformer.config.in_channels // 4,
            height,
            width,
            embeds.dtype,
            device,
            generator_of(request),
            None,
        )
        prepared.conditioning["img_ids"] = image_ids
        steps = request.num_inference_steps
        sigmas = np.linspace(1.0, 1 / steps, steps)
        if getattr(pipe.scheduler.config, "use_flow_sigmas", False):
            sigmas = None
        config = pipe.scheduler.config
        mu = calculate_shift(
            prepared.latents.shape[1],
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        prepared.timesteps, _ = retrieve_timesteps(pipe.scheduler, steps, device, sigmas=sigmas, mu=mu)
        pipe.scheduler.set_begin_index(0)

    def scale_model_input(self, pipe, model_input, t):
        return model_input

    def model_kwargs(self, pipe, prepared, model_input, t):
        rows = model_input.shape[0]
        guidance = None
        if pipe.transformer.config.guidance_embeds:  # guidance-distilled models take the scale as an input
            guidance = torch.full(
                [rows], prepared.extra["distilled_guidance"], device=model_input.device, dtype=torch.float32
            )
        return dict(
            hidden_states=model_input,
            timestep=t.expand(rows).to(model_input.dtype) / 1000,
            guidance=guidance,
            return_dict=False,
            **prepared.conditioning,
        )

    def decode(self, pipe, prepared, latents, output_type):
        if output_type == "latent":
            return latents
        height, width = prepared.extra["size"]
        latents = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)
        latents = latents / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
        image = pipe.vae.decode(latents, return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type=output_type)
