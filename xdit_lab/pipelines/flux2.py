"""Flux.2 [dev]: a Mistral 3 text encoder (three layers' states stacked), packed 2×2 latent tokens
with 4-axis position ids, a guidance-distilled transformer, flow matching, a VAE with a batch norm
over the patched latent.

diffusers' Flux2Pipeline has no negative prompt and no unconditional branch: guidance_scale is the
model's input (guidance-distilled), so cfg 2 has nothing to split and a negative prompt is refused.
Every prompt is padded to max_sequence_length and the transformer attends to the padding as
diffusers' does, so the ranks' rows stack as they are."""

from __future__ import annotations

import numpy as np
import torch
from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu, retrieve_timesteps
from diffusers.pipelines.flux2.pipeline_output import Flux2PipelineOutput

from .base import Recipe, generator_of


class Flux2Recipe(Recipe):
    family = "Flux.2"
    pipeline_classes = ("Flux2Pipeline",)
    output_class = Flux2PipelineOutput
    defaults = dict(num_inference_steps=50, guidance_scale=4.0)  # the distilled guidance, an input
    options = dict(max_sequence_length=512, text_encoder_out_layers=(10, 20, 30))
    cfg_needs = None  # never two branches: see the module's docstring

    def size_multiple(self, pipe):
        default = pipe.default_sample_size * pipe.vae_scale_factor
        return pipe.vae_scale_factor * 2, (default, default)  # latents are packed in 2×2 patches

    def default_latent_side(self, transformer_config):
        return 128  # Flux2Pipeline's default_sample_size (not in the transformer's config)

    def do_cfg(self, request):
        return False

    def encode_texts(self, pipe, request, texts, device, *, negative):
        embeds, text_ids = pipe.encode_prompt(
            prompt=texts,
            device=device,
            num_images_per_prompt=1,
            max_sequence_length=request.options["max_sequence_length"],
            text_encoder_out_layers=tuple(request.options["text_encoder_out_layers"]),
        )
        # the transformer reads one row of ids whatever the batch (ids[0]): hand it that row, unbatched
        return dict(encoder_hidden_states=embeds, txt_ids=text_ids[0])

    def prepare(self, pipe, request, prepared, device):
        default = pipe.default_sample_size * pipe.vae_scale_factor
        height, width = request.height or default, request.width or default
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
        prepared.conditioning["img_ids"] = image_ids[0]
        prepared.extra["image_ids"] = image_ids  # where each token goes back in the latent, for decode
        steps = request.num_inference_steps
        sigmas = np.linspace(1.0, 1 / steps, steps)
        if getattr(pipe.scheduler.config, "use_flow_sigmas", False):
            sigmas = None
        mu = compute_empirical_mu(image_seq_len=prepared.latents.shape[1], num_steps=steps)
        prepared.timesteps, _ = retrieve_timesteps(pipe.scheduler, steps, device, sigmas=sigmas, mu=mu)
        pipe.scheduler.set_begin_index(0)

    def scale_model_input(self, pipe, model_input, t):
        return model_input.to(pipe.transformer.dtype)

    def model_kwargs(self, pipe, prepared, model_input, t):
        rows = model_input.shape[0]
        guidance = torch.full([rows], prepared.guidance_scale, device=model_input.device, dtype=torch.float32)
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
        latents = pipe._unpack_latents_with_ids(latents, prepared.extra["image_ids"])
        norm = pipe.vae.bn
        mean = norm.running_mean.view(1, -1, 1, 1).to(latents)
        std = torch.sqrt(norm.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps).to(latents)
        latents = pipe._unpatchify_latents(latents * std + mean)
        image = pipe.vae.decode(latents.to(pipe.vae.dtype), return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type=output_type)
