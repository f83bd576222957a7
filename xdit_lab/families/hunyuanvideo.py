"""HunyuanVideo: Llama states (padded to max_sequence_length, masked) and CLIP's pooled embedding,
video latents [B, C, F, H, W], joint attention with the text after the image (masked padding), a token
refiner over the text alone, guidance-distilled, flow matching.

diffusers' HunyuanVideoPipeline runs the negative prompt as a second forward (true CFG, when
true_cfg_scale > 1 and a negative prompt is given); here both go in one batch [negative; positive],
which cfg 2 then splits. Every prompt's text is padded to the same max_sequence_length, so the
branches and the ranks' rows stack as they are."""

from __future__ import annotations

import numpy as np
import torch

from .adapter import IMAGE_ONLY, VIDEO, FamilyAdapter, PerToken
from .qwenimage import padded_text_mask
from .recipe import TrueCFGRecipe, VideoRecipe
from .tiny_spec import MAX_TOKENS, TEXT_DIM, Part, TinySpec, flow_scheduler, text_parts

ADAPTER = FamilyAdapter(
    "hunyuanvideo",
    "HunyuanVideoTransformer3DModel",
    shard_at="x_embedder",
    attention={  # the single-stream blocks' [image; text] joined in the processor
        r"^(single_)?transformer_blocks\.\d+\.attn$": "joint_last",
        r"^context_embedder\.token_refiner\.refiner_blocks\.\d+\.attn$": "text",
    },
    latents=VIDEO,
    rotary_at="rope",  # computed from the latents, before the tokens are sharded
    rotary=IMAGE_ONLY,
    text_key_mask=True,
    # image-to-video with token replace: every block modulates the first frame's tokens (a count the forward
    # hands each block, its num_tokens) at t = 0, the others at t
    per_token=(PerToken(r"^(single_)?transformer_blocks\.\d+$", "num_tokens", prefix=True),),
    block_lists=("transformer_blocks", "single_transformer_blocks"),
)


class HunyuanVideoRecipe(VideoRecipe, TrueCFGRecipe):
    pipeline_classes = ("HunyuanVideoPipeline",)
    output_class = "diffusers.pipelines.hunyuan_video.pipeline_output:HunyuanVideoPipelineOutput"
    default_size = (720, 1280)  # HunyuanVideoPipeline's
    defaults = dict(num_inference_steps=50, guidance_scale=6.0)  # the distilled guidance, an input
    options = dict(true_cfg_scale=1.0, num_frames=129, max_sequence_length=256, prompt_template=None)

    def check_options(self, options):
        options = super().check_options(options)
        if options["prompt_template"] is None:  # diffusers' own template, imported when a call needs it
            from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

            options["prompt_template"] = DEFAULT_PROMPT_TEMPLATE
        return options

    counted_with = " with the template's closing tokens"

    def prompt_tokens(self, pipe, request, text):
        # Llama's tokens of the prompt in its template, less the template's opening the pipeline crops
        template = request.options["prompt_template"]
        crop = template.get("crop_start")
        if crop is None:  # as HunyuanVideoPipeline._get_llama_prompt_embeds counts it
            crop = pipe.tokenizer(template["template"], padding="max_length", return_tensors="pt").input_ids.shape[-1]
            crop -= 2  # its <|eot_id|> and the {} placeholder
        return len(pipe.tokenizer(template["template"].format(text)).input_ids) - crop

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
        from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import retrieve_timesteps

        steps = request.num_inference_steps
        sigmas = np.linspace(1.0, 0.0, steps + 1)[:-1]
        prepared.timesteps, _ = retrieve_timesteps(pipe.scheduler, steps, device, sigmas=sigmas)
        pipe.scheduler.set_begin_index(0)
        prepared.latents = self.video_latents(pipe, request, device)

    def planned_text_bytes(self, transformer, call, element):
        text = call.options["max_sequence_length"]  # Llama's states padded to it, with a mask in the model's dtype
        return (text * transformer["text_embed_dim"] + text + transformer["pooled_projection_dim"]) * element

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

    def decoded(self, pipe, prepared, latents):
        return pipe.vae.decode(latents.to(pipe.vae.dtype) / pipe.vae.config.scaling_factor, return_dict=False)[0]


RECIPE = HunyuanVideoRecipe()


def tiny_inputs(batch, height, width, text, timestep, randn):
    """Two latent frames; padded text, a different length per sample."""
    return dict(
        hidden_states=randn(batch, 4, 2, height, width),
        encoder_hidden_states=text,
        encoder_attention_mask=padded_text_mask(batch, text.shape[1]).long(),
        pooled_projections=randn(batch, TEXT_DIM),
        timestep=timestep.long(),
        guidance=torch.full((batch,), 6000.0),  # HunyuanVideoPipeline's guidance_scale 6 × 1000
    )


TINY = TinySpec(  # modelled on diffusers' own test of HunyuanVideoTransformer3DModel
    transformer=dict(
        in_channels=4, out_channels=4, patch_size=2, patch_size_t=1, rope_axes_dim=(4, 6, 6),
        num_single_layers=2, num_refiner_layers=1, text_embed_dim=TEXT_DIM, pooled_projection_dim=TEXT_DIM,
        guidance_embeds=True,  # HunyuanVideo is guidance-distilled
    ),
    inputs=tiny_inputs,
    pipeline_classes=("HunyuanVideoPipeline",),
    parts=dict(  # Llama states (padded, masked) and CLIP's pooled embedding
        **text_parts("llama", seed=1),
        **text_parts("clip", seed=3, component="_2", width=TEXT_DIM, projection=False, positions=77),
        vae=Part("hunyuan_vae", seed=2, kwargs=dict(latent_channels=4)),
        scheduler=flow_scheduler(shift=7.0),
    ),
    # 2 latent frames of 8 × 8: 2 × 4 × 4 tokens; the text padded to 8, masked
    call=dict(
        height=64, width=64, num_frames=5, max_sequence_length=MAX_TOKENS,
        prompt_template=Part("hunyuan_prompt_template"),
    ),
)  # fmt: skip
