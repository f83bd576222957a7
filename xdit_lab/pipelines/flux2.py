"""Flux.2 [dev]: a Mistral 3 text encoder (three layers' states stacked), packed 2×2 latent tokens
with 4-axis position ids, a guidance-distilled transformer, flow matching, a VAE with a batch norm
over the patched latent.

diffusers' Flux2Pipeline has no negative prompt and no unconditional branch: guidance_scale is the
model's input (guidance-distilled), so cfg 2 has nothing to split and a negative prompt is refused.
Every prompt is padded to max_sequence_length and the transformer attends to the padding as
diffusers' does, so the ranks' rows stack as they are."""

from __future__ import annotations

import torch
from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu
from diffusers.pipelines.flux2.pipeline_output import Flux2PipelineOutput

from .base import PackedLatentsRecipe


class Flux2Recipe(PackedLatentsRecipe):
    family = "Flux.2"
    pipeline_classes = ("Flux2Pipeline",)
    output_class = Flux2PipelineOutput
    defaults = dict(num_inference_steps=50, guidance_scale=4.0)  # the distilled guidance, an input
    options = dict(max_sequence_length=512, text_encoder_out_layers=(10, 20, 30))
    cfg_needs = None  # never two branches: see the module's docstring

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
        prepared.latents, image_ids = self.packed_latents(pipe, request, prepared, device)
        prepared.conditioning["img_ids"] = image_ids[0]
        prepared.extra["image_ids"] = image_ids  # where each token goes back in the latent, for decode
        mu = compute_empirical_mu(image_seq_len=prepared.latents.shape[1], num_steps=request.num_inference_steps)
        self.set_timesteps(pipe, request, prepared, device, mu)

    def guidance_input(self, pipe, prepared):
        return prepared.guidance_scale  # handed over always, as Flux2Pipeline does

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
