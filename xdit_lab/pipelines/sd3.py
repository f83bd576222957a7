"""Stable Diffusion 3 / 3.5: two CLIP and one T5 text encoders, joint attention, flow matching."""

from __future__ import annotations

from diffusers.pipelines.stable_diffusion_3.pipeline_output import StableDiffusion3PipelineOutput
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift, retrieve_timesteps

from .base import Recipe, generator_of


class SD3Recipe(Recipe):
    family = "SD3"
    pipeline_classes = ("StableDiffusion3Pipeline",)
    output_class = StableDiffusion3PipelineOutput
    defaults = dict(num_inference_steps=28, guidance_scale=7.0)
    options = dict(max_sequence_length=256, clip_skip=None, mu=None)

    def encode_texts(self, pipe, request, texts, device, *, negative):
        embeds, _, pooled, _ = pipe.encode_prompt(
            prompt=texts,
            prompt_2=None,
            prompt_3=None,
            do_classifier_free_guidance=False,
            device=device,
            num_images_per_prompt=1,
            clip_skip=None if negative else request.options["clip_skip"],  # diffusers skips none for negatives
            max_sequence_length=request.options["max_sequence_length"],
        )
        return dict(encoder_hidden_states=embeds, pooled_projections=pooled)

    def prepare(self, pipe, request, prepared, device):
        height = request.height or pipe.default_sample_size * pipe.vae_scale_factor
        width = request.width or pipe.default_sample_size * pipe.vae_scale_factor
        embeds = prepared.conditioning["encoder_hidden_states"]
        prepared.latents = pipe.prepare_latents(
            len(request.prompts),
            pipe.transformer.config.in_channels,
            height,
            width,
            embeds.dtype,
            device,
            generator_of(request),
            None,
        )
        scheduler_kwargs = {}
        mu = request.options["mu"]
        config = pipe.scheduler.config
        if config.get("use_dynamic_shifting", None) and mu is None:
            patch = pipe.transformer.config.patch_size
            tokens = (prepared.latents.shape[2] // patch) * (prepared.latents.shape[3] // patch)
            mu = calculate_shift(
                tokens,
                config.get("base_image_seq_len", 256),
                config.get("max_image_seq_len", 4096),
                config.get("base_shift", 0.5),
                config.get("max_shift", 1.16),
            )
        if mu is not None:
            scheduler_kwargs["mu"] = mu
        prepared.timesteps, _ = retrieve_timesteps(
            pipe.scheduler, request.num_inference_steps, device, **scheduler_kwargs
        )

    def scale_model_input(self, pipe, model_input, t):
        return model_input  # flow matching feeds latents as they are

    def decode(self, pipe, prepared, latents, output_type):
        if output_type == "latent":
            return latents
        latents = latents / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
        image = pipe.vae.decode(latents, return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type=output_type)
