"""Stable Diffusion 3 / 3.5: two CLIP and one T5 text encoders, joint attention with the text after the
image, flow matching. SD3.5's dual attention layers add an image-only self-attention (attn2) beside
the joint one in the same block.

StableDiffusion3ControlNetPipeline runs a ControlNet (SD3ControlNetModel: SD3's joint blocks, fewer of them, and
the control image's latents patch-embedded apart, pos_embed_input, and added to the tokens) on the whole CFG
batch before the transformer at every step; its residuals, one [B, S, D] per block it feeds, are added to the
transformer's image states. As Flux's (flux.py), the ControlNet is parallelized on the transformer's mesh with
its layout (CONTROLNET_ADAPTER, pos_embed_input's tokens cut with the others), and its residuals, each rank's
already, are handed over as they are. diffusers samples the control image's latents from torch's global
generator; here they are drawn from a generator seeded with the request's seed, the same on every rank."""

from __future__ import annotations

import torch

from .adapter import BlockResiduals, FamilyAdapter, PerToken
from .controlnet import CONTROLNET_OPTIONS, ControlNetRecipe, runs_controlnet
from .recipe import (
    RequestShape,
    prompt_embeds,
    shifted_vae_decoded,
    vae_scale,
)
from .tiny_spec import INNER, MAX_TOKENS, TEXT_DIM, TinySpec, flow_scheduler, flow_vae, text_parts


def _spread_residual(block: int, blocks: int, residuals: int, arguments: dict) -> int:
    """The residual SD3Transformer2DModel's forward adds at `block` of `blocks`: int(block / (blocks / residuals))."""
    return int(block / (blocks / residuals))


ADAPTER = FamilyAdapter(
    "sd3",
    "SD3Transformer2DModel",
    shard_at="pos_embed",
    attention={r"^transformer_blocks\.\d+\.attn$": "joint_last", r"\.attn2$": "self"},
    text_shard_at="input",  # its context_embedder works token by token; skip_layers may skip block 0
    # a ControlNet's residuals, [B, S, D] per block it feeds, added to the image states: cut with them, and under
    # PipeFusion each stage given its own blocks' (the forward picks block g's as int(g / (n / len(R))))
    per_token=(PerToken("", "block_controlnet_hidden_states"),),
    block_residuals=(BlockResiduals("block_controlnet_hidden_states", "transformer_blocks", _spread_residual),),
    # tensor parallelism (diffusers declares no _tp_plan for SD3), as Flux's double-stream blocks: image and text
    # attention split by heads (SD3.5's qk RMSNorms are per head), both MLPs by width (the last block has no text
    # output or MLP: its globs match the others'); the modulations split and gathered. SD3.5 Medium's second
    # (image-only) attention, in some blocks, stays whole: a glob must name a layer in every model of the family
    tp_plan={
        **{f"transformer_blocks.*.attn.{p}": "colwise" for p in ("to_q", "to_k", "to_v")},
        **{f"transformer_blocks.*.attn.{p}": "colwise" for p in ("add_q_proj", "add_k_proj", "add_v_proj")},
        "transformer_blocks.*.attn.to_out.0": "rowwise",
        "transformer_blocks.*.attn.to_add_out": "rowwise",
        **{f"transformer_blocks.*.{ff}.net.0.proj": "colwise" for ff in ("ff", "ff_context")},
        **{f"transformer_blocks.*.{ff}.net.2": "rowwise" for ff in ("ff", "ff_context")},
    },
    tp_gathered=("transformer_blocks.*.norm1.linear", "transformer_blocks.*.norm1_context.linear", "norm_out.linear"),
)

# the ControlNet: SD3's layout, its control image's tokens (pos_embed_input's) cut with the image's, no output
# gathered (its residuals stay this rank's)
CONTROLNET_ADAPTER = FamilyAdapter(
    "sd3",
    "SD3ControlNetModel",
    shard_at="pos_embed",
    shard_also=("pos_embed_input",),
    gather_at=None,
    attention={r"^transformer_blocks\.\d+\.attn$": "joint_last", r"\.attn2$": "self"},
    text_shard_at="input",
)


class SD3Recipe(ControlNetRecipe):
    pipeline_classes = ("StableDiffusion3Pipeline", "StableDiffusion3ControlNetPipeline")
    tasks = dict(StableDiffusion3ControlNetPipeline="ControlNet")
    controlnet_model = "SD3ControlNetModel"
    output_class = "diffusers.pipelines.stable_diffusion_3.pipeline_output:StableDiffusion3PipelineOutput"
    defaults = dict(num_inference_steps=28, guidance_scale=7.0)
    options = dict(max_sequence_length=256, clip_skip=None, mu=None, **CONTROLNET_OPTIONS)

    def check_controlnet(self, pipe):
        if pipe.controlnet.config.joint_attention_dim is None:
            raise NotImplementedError(
                "an SD3.5 ControlNet without text (joint_attention_dim None: SD3.5 Large's own, its blocks attend to "
                "the image alone and share the transformer's pos_embed) is not run by xdit_lab yet; SD3 ControlNets "
                "with joint attention (InstantX's) are"
            )

    bounded_tokenizer = "tokenizer_3"  # T5's; CLIP reads its 77 tokens whatever max_sequence_length says
    longest_text = 512  # StableDiffusion3Pipeline.check_inputs

    def prompt_tokens(self, pipe, request, text):
        return None if pipe.text_encoder_3 is None else super().prompt_tokens(pipe, request, text)  # no T5: zeros

    def encode_texts(self, pipe, request, texts, device, *, negative):
        clip_skip = None if negative else request.options["clip_skip"]  # diffusers skips none for negatives
        embeds, _, pooled, _ = prompt_embeds(
            pipe,
            request,
            texts,
            device,
            prompt_2=None,
            prompt_3=None,
            do_classifier_free_guidance=False,
            clip_skip=clip_skip,
        )
        return dict(encoder_hidden_states=embeds, pooled_projections=pooled)

    def prepare(self, pipe, request, prepared, device):
        from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import (
            calculate_shift,
            retrieve_timesteps,
        )

        height = request.height or pipe.default_sample_size * pipe.vae_scale_factor
        width = request.width or pipe.default_sample_size * pipe.vae_scale_factor
        prepared.latents = self.image_latents(pipe, request, prepared, device, height, width)
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

        if runs_controlnet(pipe):
            self._prepare_control(pipe, request, prepared, device, height, width)

    def _prepare_control(self, pipe, request, prepared, device, height, width):
        """StableDiffusion3ControlNetPipeline's: the control image at the request's size, one copy per branch, its
        latents sampled from the VAE (from a generator of the request's seed, where diffusers takes torch's global
        one), shifted (unless the ControlNet zeroes its pooled input, InstantX's) and scaled; and the ControlNet's
        scale at each step."""
        image = pipe.prepare_image(
            image=request.options["control_image"], width=width, height=height, batch_size=len(request.prompts),
            num_images_per_prompt=1, device=device, dtype=pipe.transformer.dtype,
            do_classifier_free_guidance=prepared.do_cfg, guess_mode=False,
        )  # fmt: skip
        latents = pipe.vae.encode(image).latent_dist.sample(generator=_control_generator(request))
        shift = 0 if pipe.controlnet.config.force_zeros_for_pooled_projection else pipe.vae.config.shift_factor
        self.keep_control(prepared, request, (latents - shift) * pipe.vae.config.scaling_factor)

    def controlnet_kwargs(self, pipe, prepared, model_input, kwargs, control, scale):
        pooled = kwargs["pooled_projections"]  # InstantX's ControlNets take zeros
        if pipe.controlnet.config.force_zeros_for_pooled_projection:
            pooled = torch.zeros_like(pooled)
        (blocks,) = pipe.controlnet(  # parallelized like the transformer (whole under PipeFusion): cut as it cuts
            hidden_states=model_input,
            timestep=kwargs["timestep"],
            encoder_hidden_states=kwargs["encoder_hidden_states"],
            pooled_projections=pooled,
            controlnet_cond=control,
            conditioning_scale=scale,
            return_dict=False,
        )
        return dict(block_controlnet_hidden_states=blocks)

    def scale_model_input(self, pipe, model_input, t):
        return model_input  # flow matching feeds latents as they are

    def planned_request(self, configs, call, element):
        t = configs["transformer"]
        scale = vae_scale(configs["vae"])[0]
        rows, cols = call.height // scale, call.width // scale
        text = clip_length(configs) + call.options["max_sequence_length"]  # [CLIP; T5]
        per_row = text * t["joint_attention_dim"] * element + t["pooled_projection_dim"] * element
        patch = t["patch_size"]
        latents = t["in_channels"] * rows * cols * element
        return RequestShape(latents, per_row, 0, (rows // patch, cols // patch), (t["in_channels"], rows, cols))

    def decoded(self, pipe, prepared, latents):
        return shifted_vae_decoded(pipe, latents)


RECIPE = SD3Recipe()


def _control_generator(request):
    """The control image's sampling generator: a CPU generator of the request's seed (or of its generator's), the
    same on every rank; with neither, None: torch's global generator, as seed=None draws the noise too."""
    if request.seed is not None:
        return torch.Generator("cpu").manual_seed(request.seed)
    generator = request.generator[0] if isinstance(request.generator, list) else request.generator
    return None if generator is None else torch.Generator("cpu").manual_seed(generator.initial_seed())


def clip_length(configs: dict) -> int:
    """CLIP's padded length: its tokenizer's model_max_length where the folder has the tokenizer's config,
    else the encoder's positions (77), which is what the published tokenizers say."""
    length = configs.get("tokenizer", {}).get("model_max_length")
    if isinstance(length, int) and length < 10**6:
        return length
    return configs["text_encoder"]["max_position_embeddings"]


def tiny_inputs(batch, height, width, text, timestep, randn):
    return dict(
        hidden_states=randn(batch, 16, height, width),
        encoder_hidden_states=text,
        pooled_projections=randn(batch, TEXT_DIM),
        timestep=timestep,
    )


TINY = TinySpec(  # CLIP 16 + 16 wide = T5 32 = the joint dim; pooled 16 + 16
    transformer=dict(
        sample_size=8, patch_size=2, in_channels=16, out_channels=16, pos_embed_max_size=32,
        joint_attention_dim=TEXT_DIM, caption_projection_dim=INNER, pooled_projection_dim=TEXT_DIM,
    ),
    inputs=tiny_inputs,
    pipeline_classes=("StableDiffusion3Pipeline",),
    parts=dict(
        **text_parts("clip", seed=3, width=TEXT_DIM // 2, projection=True),
        **text_parts("clip", seed=4, component="_2", width=TEXT_DIM // 2, projection=True),
        **text_parts("t5", seed=1, component="_3"),
        vae=flow_vae(scaling_factor=1.5305, shift_factor=0.0609),
        scheduler=flow_scheduler(shift=3.0),
    ),
    call=dict(height=16, width=16, max_sequence_length=MAX_TOKENS),
)  # fmt: skip
