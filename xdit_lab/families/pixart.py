"""PixArt-α and PixArt-Σ: T5 text by cross-attention, learned sigma, DPM-Solver by default.

The image tokens attend to each other (self, sequence-parallel) and to the whole text (cross: local
on every rank, nothing moves)."""

from __future__ import annotations

import torch

from .adapter import FamilyAdapter
from .recipe import Recipe, RequestShape, binned_size, generator_of, vae_scale
from .tiny_spec import INNER, MAX_TOKENS, TEXT_DIM, Part, TinySpec, text_parts


def teacache_input(block, argument):
    """TeaCache's modulated input of PixArt's first block (diffusers' BasicTransformerBlock, ada_norm_single):
    norm1(hidden_states) × (1 + scale) + shift, the first two of the six modulations its scale_shift_table adds to
    the embedded timestep [B, 6·dim] the forward hands every block, what its self-attention takes."""
    hidden = argument("hidden_states")
    modulations = block.scale_shift_table[None] + argument("timestep").reshape(hidden.shape[0], 6, -1)
    shift, scale = modulations.chunk(6, dim=1)[:2]
    return block.norm1(hidden) * (1 + scale) + shift


ADAPTER = FamilyAdapter(
    "pixart",
    "PixArtTransformer2DModel",
    shard_at="pos_embed",
    attention={r"\.attn1$": "self", r"\.attn2$": "cross"},
    # tensor parallelism (diffusers declares no _tp_plan for PixArt): self and cross attention split by heads (no
    # qk norm), the MLP by width; the one modulation [B, 6·dim] (adaln_single, shared by every block's
    # scale_shift_table) split and gathered
    tp_plan={
        **{
            f"transformer_blocks.*.{attn}.{p}": "colwise"
            for attn in ("attn1", "attn2")
            for p in ("to_q", "to_k", "to_v")
        },
        "transformer_blocks.*.attn1.to_out.0": "rowwise",
        "transformer_blocks.*.attn2.to_out.0": "rowwise",
        "transformer_blocks.*.ff.net.0.proj": "colwise",
        "transformer_blocks.*.ff.net.2": "rowwise",
    },
    tp_gathered=("adaln_single.linear",),
    teacache=teacache_input,
)


class PixArtRecipe(Recipe):
    pipeline_classes = ("PixArtAlphaPipeline", "PixArtSigmaPipeline")
    defaults = dict(num_inference_steps=20, guidance_scale=4.5)
    options = dict(eta=0.0, use_resolution_binning=True, clean_caption=True, max_sequence_length=None)

    def prompt_tokens(self, pipe, request, text):
        # what encode_prompt tokenizes: the text cleaned (clean_caption, with bs4 and ftfy) or lower-cased
        text = pipe._text_preprocessing(text, clean_caption=request.options["clean_caption"])[0]
        return super().prompt_tokens(pipe, request, text)

    def encode_texts(self, pipe, request, texts, device, *, negative):
        # diffusers encodes negative prompts as it does prompts (same preprocessing and length)
        options = request.options
        kwargs = (
            {} if options["max_sequence_length"] is None else {"max_sequence_length": options["max_sequence_length"]}
        )
        embeds, mask, _, _ = pipe.encode_prompt(
            texts, False, num_images_per_prompt=1, device=device, clean_caption=options["clean_caption"], **kwargs
        )
        return dict(encoder_hidden_states=embeds, encoder_attention_mask=mask)

    def prepare(self, pipe, request, prepared, device):
        from diffusers.pipelines.pixart_alpha.pipeline_pixart_alpha import retrieve_timesteps

        sample_size = pipe.transformer.config.sample_size
        height = request.height or sample_size * pipe.vae_scale_factor
        width = request.width or sample_size * pipe.vae_scale_factor
        prepared.extra["size"] = (height, width)
        if request.options["use_resolution_binning"]:
            height, width = binned_size(BINS, sample_size, height, width)
        generator = generator_of(request)
        prepared.timesteps, _ = retrieve_timesteps(pipe.scheduler, request.num_inference_steps, device)
        if hasattr(pipe.scheduler, "set_begin_index"):
            pipe.scheduler.set_begin_index(0)
        embeds = prepared.conditioning["encoder_hidden_states"]
        prepared.latents = self.image_latents(pipe, request, prepared, device, height, width, generator=generator)
        prepared.extra["step_kwargs"] = pipe.prepare_extra_step_kwargs(generator, request.options["eta"])
        added = {"resolution": None, "aspect_ratio": None}
        if sample_size == 128:  # PixArt-α 1024 takes micro-conditions
            rows = embeds.shape[0]
            added = {
                "resolution": torch.tensor([height, width]).repeat(rows, 1).to(embeds),
                "aspect_ratio": torch.tensor([float(height / width)]).repeat(rows, 1).to(embeds),
            }
        prepared.conditioning["added_cond_kwargs"] = added

    def planned_request(self, configs, call, element):
        t = configs["transformer"]
        height, width = call.height, call.width
        # a sample size without bins (a tiny specimen's) at the size asked: its pipeline refuses binning when called
        if call.options.get("use_resolution_binning", True) and t["sample_size"] in BINS:
            height, width = binned_size(BINS, t["sample_size"], height, width)
        scale = vae_scale(configs["vae"])[0]
        rows, cols = height // scale, width // scale
        text = call.options["max_sequence_length"]
        micro = 3 * element if t["sample_size"] == 128 else 0  # the resolution [2] and aspect ratio [1] per row
        per_row = text * configs["text_encoder"]["d_model"] * element + text * 8 + micro  # states, the int64 mask
        patch = t["patch_size"]
        latents = t["in_channels"] * rows * cols * element
        decoded = (configs["vae"]["latent_channels"], rows, cols)
        return RequestShape(latents, per_row, 0, (rows // patch, cols // patch), decoded)

    def model_kwargs(self, pipe, prepared, model_input, t):
        timestep = (t if t.dim() else t[None]).to(model_input.device).expand(model_input.shape[0])
        return dict(hidden_states=model_input, timestep=timestep, return_dict=False, **prepared.conditioning)

    def guide(self, pipe, prepared, noise, step_index):
        noise = super().guide(pipe, prepared, noise, step_index)
        if pipe.transformer.config.out_channels // 2 == pipe.transformer.config.in_channels:
            noise = noise.chunk(2, dim=1)[0]  # learned sigma: keep the noise half
        return noise

    def scheduler_step(self, pipe, prepared, noise, t, latents, step_index):
        stepped = pipe.scheduler.step(noise, t, latents, **prepared.extra["step_kwargs"], return_dict=False)
        if len(prepared.timesteps) > 1:
            return stepped[0]
        # one step: diffusers' PixArt takes the predicted original sample (DMD's one-step sampling)
        if len(stepped) < 2:
            raise ValueError(
                f"num_inference_steps=1 on PixArt takes the scheduler's predicted original sample (DMD's one-step "
                f"sampling), which {type(pipe.scheduler).__name__} does not return; use 2 steps or more, or a "
                f"scheduler that returns it (e.g. DDIMScheduler, LCMScheduler)"
            )
        return stepped[1]

    def decoded(self, pipe, prepared, latents):
        image = pipe.vae.decode(latents / pipe.vae.config.scaling_factor, return_dict=False)[0]
        if tuple(image.shape[-2:]) != prepared.extra["size"]:  # resolution binning changed the size
            height, width = prepared.extra["size"]
            image = pipe.image_processor.resize_and_crop_tensor(image, width, height)
        return image


RECIPE = PixArtRecipe()


# the aspect-ratio bins PixArt's pipelines render a model's sample size at: 256, 512 and 1024 pixels
BINS = {
    32: "pixart_alpha.pipeline_pixart_alpha:ASPECT_RATIO_256_BIN",
    64: "pixart_alpha.pipeline_pixart_alpha:ASPECT_RATIO_512_BIN",
    128: "pixart_alpha.pipeline_pixart_alpha:ASPECT_RATIO_1024_BIN",
}


def tiny_inputs(batch, height, width, text, timestep, randn):
    return dict(
        hidden_states=randn(batch, 4, height, width),
        encoder_hidden_states=text,
        timestep=timestep,
        added_cond_kwargs={"resolution": None, "aspect_ratio": None},
    )


TINY = TinySpec(  # learned sigma: out = 2 × 4 latent channels
    transformer=dict(
        in_channels=4, out_channels=8, cross_attention_dim=INNER, caption_channels=TEXT_DIM, sample_size=8,
        patch_size=2, norm_type="ada_norm_single", use_additional_conditions=False,
    ),
    inputs=tiny_inputs,
    pipeline_classes=("PixArtAlphaPipeline", "PixArtSigmaPipeline"),
    parts=dict(
        **text_parts("t5", seed=1),
        vae=Part("image_vae", seed=2, kwargs=dict(latent_channels=4, scaling_factor=0.18215)),
        scheduler=Part("DPMSolverMultistepScheduler"),
    ),
    call=dict(height=16, width=16, max_sequence_length=MAX_TOKENS, use_resolution_binning=False, clean_caption=False),
)  # fmt: skip
