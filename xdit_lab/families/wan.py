"""Wan 2.1: a T5-family (UMT5) text encoder, video latents [B, C, F, H, W], self-attention over the video's
tokens with the text by cross-attention (which moves nothing), flow matching.

Wan 2.2 TI2V 5B's text-to-video runs (WanPipeline with expand_timesteps: a timestep per token, [B, S],
which every rank cuts with its tokens, adapter.PerToken). Wan 2.2's two-expert pipelines (boundary_ratio:
a second transformer for the low-noise steps) are refused by name: the second transformer is not
parallelized here."""

from __future__ import annotations

import torch

from .adapter import IMAGE_ONLY, VIDEO, FamilyAdapter, PerToken
from .recipe import VideoRecipe, causal_vae_decoded, video_prompt_embeds
from .tiny_spec import MAX_TOKENS, TEXT_DIM, Part, TinySpec, flow_scheduler, text_parts

ADAPTER = FamilyAdapter(
    "wan",
    "WanTransformer3DModel",
    shard_at="patch_embedding",
    attention={r"\.attn1$": "self", r"\.attn2$": "cross"},
    latents=VIDEO,
    grid_at_shard=True,
    rotary_at="rope",
    rotary=IMAGE_ONLY,
    block_lists=("blocks",),
    per_token=(PerToken("", "timestep", dim=1, dims=2),),  # Wan 2.2 TI2V: a timestep per token, [B, S]
)


class WanRecipe(VideoRecipe):
    pipeline_classes = ("WanPipeline",)
    output_class = "diffusers.pipelines.wan.pipeline_output:WanPipelineOutput"
    default_size = (480, 832)  # WanPipeline's
    defaults = dict(num_inference_steps=50, guidance_scale=5.0)
    options = dict(num_frames=81, max_sequence_length=512)

    def prompt_tokens(self, pipe, request, text):
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean  # what encode_prompt tokenizes

        return super().prompt_tokens(pipe, request, prompt_clean(text))

    def check_pipeline(self, pipe) -> None:
        if pipe.config.get("boundary_ratio") is not None or getattr(pipe, "transformer_2", None) is not None:
            raise NotImplementedError(
                "Wan 2.2's two-expert pipeline (boundary_ratio, transformer_2) is not run by xdit_lab yet: only its "
                "first transformer would be parallelized; use a single-transformer Wan 2.1 pipeline"
            )

    def encode_texts(self, pipe, request, texts, device, *, negative):
        embeds = video_prompt_embeds(pipe, request, texts, device)
        return dict(encoder_hidden_states=embeds.to(pipe.transformer.dtype))

    def prepare(self, pipe, request, prepared, device):
        pipe.scheduler.set_timesteps(request.num_inference_steps, device=device)
        pipe.scheduler.set_begin_index(0)
        prepared.timesteps = pipe.scheduler.timesteps
        prepared.latents = self.video_latents(pipe, request, device)

    def model_kwargs(self, pipe, prepared, model_input, t):
        kwargs = super().model_kwargs(pipe, prepared, model_input, t)
        if pipe.config.get("expand_timesteps"):  # Wan 2.2 TI2V: WanPipeline's timestep per token, [B, S]
            # (a mask of ones over the latent grid, strided by the 2 × 2 patch its pipeline assumes, times t)
            mask = torch.ones(model_input.shape[2:], dtype=torch.float32, device=model_input.device)
            per_token = (mask[:, ::2, ::2] * t).flatten()
            kwargs["timestep"] = per_token.unsqueeze(0).expand(model_input.shape[0], -1)
        return kwargs

    def planned_text_bytes(self, transformer, call, element):
        return call.options["max_sequence_length"] * transformer["text_dim"] * element  # UMT5's states

    def decoded(self, pipe, prepared, latents):
        return causal_vae_decoded(pipe, latents)


RECIPE = WanRecipe()


def tiny_inputs(batch, height, width, text, timestep, randn):  # two latent frames
    return dict(hidden_states=randn(batch, 4, 2, height, width), encoder_hidden_states=text, timestep=timestep.long())


TINY = TinySpec(  # modelled on diffusers' own test of WanTransformer3DModel
    transformer=dict(
        patch_size=(1, 2, 2), in_channels=4, out_channels=4, text_dim=TEXT_DIM, freq_dim=32, ffn_dim=32,
        cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    ),
    inputs=tiny_inputs,
    pipeline_classes=("WanPipeline",),
    parts=dict(  # Wan 2.1's layout: one transformer, flow matching with shift
        **text_parts("t5", seed=1, umt5=True),
        vae=Part("wan_vae", seed=2, kwargs=dict(latent_channels=4)),
        scheduler=flow_scheduler(shift=3.0),
    ),
    # 5 frames -> 2 latent frames of 8 × 8
    call=dict(height=64, width=64, num_frames=5, max_sequence_length=MAX_TOKENS),
)  # fmt: skip
