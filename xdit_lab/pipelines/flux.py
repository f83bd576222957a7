"""Flux.1: CLIP pooled + T5 text, packed 2×2 latent tokens, guidance embedding, true CFG optional.

diffusers' FluxPipeline runs the negative prompt as a second forward (true CFG, when
true_cfg_scale > 1 and a negative prompt is given); here both go in one batch
[negative; positive], which cfg 2 then splits over two ranks."""

from __future__ import annotations

from diffusers.pipelines.flux.pipeline_output import FluxPipelineOutput

from .base import PackedLatentsRecipe, TrueCFGRecipe


class FluxRecipe(PackedLatentsRecipe, TrueCFGRecipe):
    family = "Flux"
    pipeline_classes = ("FluxPipeline",)
    output_class = FluxPipelineOutput
    defaults = dict(num_inference_steps=28, guidance_scale=3.5)
    options = dict(true_cfg_scale=1.0, max_sequence_length=512)

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
        prepared.latents, prepared.conditioning["img_ids"] = self.packed_latents(pipe, request, prepared, device)
        self.set_timesteps(pipe, request, prepared, device, self.image_tokens_shift(pipe, prepared.latents.shape[1]))

    def decode(self, pipe, prepared, latents, output_type):
        if output_type == "latent":
            return latents
        height, width = prepared.extra["size"]
        latents = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)
        latents = latents / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
        image = pipe.vae.decode(latents, return_dict=False)[0]
        return pipe.image_processor.postprocess(image, output_type=output_type)
