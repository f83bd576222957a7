"""Qwen-Image: a Qwen2.5-VL text encoder, packed 2×2 latent tokens, joint attention over padded
text, true CFG with a norm-preserving rescale, flow matching.

diffusers' QwenImagePipeline encodes the prompts and the negative prompts apart, each padded to its
own longest prompt with a mask (None when nothing is padded), and runs the negative branch as a
second forward. Here both branches go in one batch [negative; positive], which cfg 2 then splits:
their text is padded to one length with the mask extended (`padded_text`), which the transformer's
masked attention makes exact, and the session pads every rank's rows to the longest over the ranks
before it gathers them."""

from __future__ import annotations

import numpy as np
import torch
from diffusers.pipelines.qwenimage.pipeline_output import QwenImagePipelineOutput
from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift, retrieve_timesteps

from .base import TrueCFGRecipe, generator_of


class QwenImageRecipe(TrueCFGRecipe):
    family = "Qwen-Image"
    pipeline_classes = ("QwenImagePipeline",)
    output_class = QwenImagePipelineOutput
    defaults = dict(num_inference_steps=50, guidance_scale=None)  # guidance_scale: a distilled model's input
    options = dict(true_cfg_scale=4.0, max_sequence_length=512)
    padded_text = ("encoder_hidden_states", "encoder_hidden_states_mask")

    def size_multiple(self, pipe):
        default = pipe.default_sample_size * pipe.vae_scale_factor
        return pipe.vae_scale_factor * 2, (default, default)  # latents are packed in 2×2 patches

    def default_latent_side(self, transformer_config):
        return 128  # QwenImagePipeline's default_sample_size (not in the transformer's config)

    def encode_texts(self, pipe, request, texts, device, *, negative):
        embeds, mask = pipe.encode_prompt(
            prompt=texts,
            device=device,
            num_images_per_prompt=1,
            max_sequence_length=request.options["max_sequence_length"],
        )
        if mask is None:  # diffusers drops a mask that masks nothing; a batch of two branches needs one
            mask = torch.ones(embeds.shape[:2], dtype=torch.bool, device=embeds.device)
        return dict(encoder_hidden_states=embeds, encoder_hidden_states_mask=mask.bool())

    def prepare(self, pipe, request, prepared, device):
        height = request.height or pipe.default_sample_size * pipe.vae_scale_factor
        width = request.width or pipe.default_sample_size * pipe.vae_scale_factor
        prepared.extra["size"] = (height, width)
        embeds = prepared.conditioning["encoder_hidden_states"]
        prepared.latents = pipe.prepare_latents(
            len(request.prompts),
            pipe.transformer.config.in_channels // 4,
            height,
            width,
            embeds.dtype,
            device,
            generator_of(request),
            None,
        )
        prepared.extra["image_shape"] = (1, height // pipe.vae_scale_factor // 2, width // pipe.vae_scale_factor // 2)
        distilled = pipe.transformer.config.guidance_embeds
        if distilled and request.guidance_scale is None:
            raise ValueError("this Qwen-Image model is guidance-distilled: give guidance_scale")
        if not distilled:  # diffusers ignores the scale then
            prepared.extra["distilled_guidance"] = None
        steps = request.num_inference_steps
        config = pipe.scheduler.config
        mu = calculate_shift(
            prepared.latents.shape[1],
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        sigmas = np.linspace(1.0, 1 / steps, steps)
        prepared.timesteps, _ = retrieve_timesteps(pipe.scheduler, steps, device, sigmas=sigmas, mu=mu)
        pipe.scheduler.set_begin_index(0)

    def scale_model_input(self, pipe, model_input, t):
        return model_input

    def model_kwargs(self, pipe, prepared, model_input, t):
        rows = model_input.shape[0]
        guidance = prepared.extra["distilled_guidance"]
        if guidance is not None:
            guidance = torch.full([rows], guidance, device=model_input.device, dtype=torch.float32)
        return dict(
            hidden_states=model_input,
            timestep=t.expand(rows).to(model_input.dtype) / 1000,
            guidance=guidance,
            img_shapes=[[prepared.extra["image_shape"]]] * rows,
            return_dict=False,
            **prepared.conditioning,
        )

    def guide(self, pipe, prepared, noise, step_index):
        """True CFG, rescaled to the conditional prediction's norm per token, as QwenImagePipeline does."""
        if not prepared.do_cfg:
            return noise
        uncond, cond = noise.chunk(2)
        guided = uncond + prepared.guidance_scale * (cond - uncond)
        return guided * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(guided, dim=-1, keepdim=True))

    def decode(self, pipe, prepared, latents, output_type):
        if output_type == "latent":
            return latents
        height, width = prepared.extra["size"]
        latents = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor).to(pipe.vae.dtype)
        config = pipe.vae.config
        mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(latents)
        std = torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(latents)
        image = pipe.vae.decode(latents * std + mean, return_dict=False)[0][:, :, 0]
        return pipe.image_processor.postprocess(image, output_type=output_type)
