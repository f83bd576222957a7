"""Wan 2.1: a T5-family (UMT5) text encoder, video latents [B, C, F, H, W], self-attention over the video's
tokens with the text by cross-attention (which moves nothing), flow matching.

Wan 2.2's pipelines are refused by name: its two-expert pipelines (boundary_ratio: a second transformer
for the low-noise steps), because the second transformer is not parallelized here, and its 5B TI2V
(expand_timesteps: a timestep per token), because a per-token timestep cannot be split with the tokens
yet."""

from __future__ import annotations

import torch

from .adapter import IMAGE_ONLY, VIDEO, FamilyAdapter
from .recipe import Recipe, RequestShape, latent_frames, vae_scale, video_latents, video_prompt_embeds
from .tiny_spec import MAX_TOKENS, TEXT_DIM, Part, TinySpec

ADAPTER = FamilyAdapter(
    "wan",
    "WanTransformer3DModel",
    shard_at="patch_embedding",
    gather_at="proj_out",
    attention={r"\.attn1$": "self", r"\.attn2$": "cross"},
    latents=VIDEO,
    grid_at_shard=True,
    rotary_at="rope",
    rotary=IMAGE_ONLY,
    block_lists=("blocks",),
)


class WanRecipe(Recipe):
    family = "wan"
    pipeline_classes = ("WanPipeline",)
    output_class = "diffusers.pipelines.wan.pipeline_output:WanPipelineOutput"
    output_field = "frames"
    defaults = dict(num_inference_steps=50, guidance_scale=5.0)
    options = dict(num_frames=81, max_sequence_length=512)

    def check_pipeline(self, pipe) -> None:
        if pipe.config.get("boundary_ratio") is not None or getattr(pipe, "transformer_2", None) is not None:
            raise NotImplementedError(
                "Wan 2.2's two-expert pipeline (boundary_ratio, transformer_2) is not run by xdit_lab yet: only its "
                "first transformer would be parallelized; use a single-transformer Wan 2.1 pipeline"
            )
        if pipe.config.get("expand_timesteps"):
            raise NotImplementedError(
                "this Wan pipeline (Wan 2.2 TI2V 5B) uses a timestep per token (expand_timesteps), which xdit_lab "
                "cannot split with the tokens yet; run a Wan 2.1 pipeline, with one timestep per sample"
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

    def planned_request(self, configs, call, element):
        t = configs["transformer"]
        scale = vae_scale(configs["vae"])[0]
        frames = latent_frames(configs, call)
        rows, cols = call.height // scale, call.width // scale
        latents = t["in_channels"] * frames * rows * cols * 4  # WanPipeline keeps its latents in float32
        per_row = call.options["max_sequence_length"] * t["text_dim"] * element
        pt, ph, pw = VIDEO.video_patch(t)
        return RequestShape(latents, per_row, 0, (frames // pt * (rows // ph), cols // pw), None, frames)

    def planned_default_size(self, configs):
        return 480, 832  # WanPipeline's

    def decode(self, pipe, prepared, latents, output_type):
        if output_type == "latent":
            return latents
        config = pipe.vae.config
        latents = latents.to(pipe.vae.dtype)
        mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(latents)
        std = torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(latents)
        video = pipe.vae.decode(latents * std + mean, return_dict=False)[0]
        return pipe.video_processor.postprocess_video(video, output_type=output_type)


RECIPE = WanRecipe()


def tiny_inputs(batch, height, width, text, timestep, randn):  # two latent frames
    return dict(hidden_states=randn(batch, 4, 2, height, width), encoder_hidden_states=text, timestep=timestep.long())


TINY = TinySpec(  # modelled on diffusers' own test of WanTransformer3DModel
    transformer=dict(
        patch_size=(1, 2, 2),
        in_channels=4,
        out_channels=4,
        text_dim=TEXT_DIM,
        freq_dim=32,
        ffn_dim=32,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    ),
    inputs=tiny_inputs,
    pipeline_classes=("WanPipeline",),
    parts=dict(  # Wan 2.1's layout: one transformer, flow matching with shift
        transformer=Part("transformer"),
        text_encoder=Part("t5_encoder", seed=1, vocab_of="tokenizer", kwargs=dict(umt5=True)),
        tokenizer=Part("t5_tokenizer"),
        vae=Part("wan_vae", seed=2, kwargs=dict(latent_channels=4)),
        scheduler=Part("FlowMatchEulerDiscreteScheduler", kwargs=dict(shift=3.0)),
    ),
    # 5 frames -> 2 latent frames of 8 × 8
    call=dict(height=64, width=64, num_frames=5, max_sequence_length=MAX_TOKENS),
)
