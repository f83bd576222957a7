"""Z-Image: a Qwen3 text encoder (the states before its last layer, each prompt's unmasked tokens alone), a
single-stream transformer over one sequence [image; caption], CFG with negative prompts, flow matching.

ZImageTransformer2DModel takes lists, one tensor per sample: the latents x [C, 1, H, W] and the captions
[L_i, D] of different lengths. Its forward pads each to a multiple of 32 tokens (the padding is a learned
token, attended), refines the image tokens alone and the caption tokens alone, then joins them per sample
into one sequence, padded across the batch with a mask, for its main layers; the final layer reads it
whole and unpatchify keeps the image's part:

    x ──patchify, embed, pad──> image [B, S, C] ──noise_refiner (self)──┐
    captions ──embed, pad──> caption [B, T, C] ──context_refiner (text)─┴─> [image; caption] [B, S + T, C]
        ──layers (joint_last, masked caption padding)──> final layer ──> unpatchify: the image's S tokens

Sequence shards cut the image tokens where the image refiner's first block takes them (shard_at_input):
the forward then joins this rank's shard with the whole caption, [image shard; caption], and the first main
layer keeps this rank's share of the caption (text_shard_at "joined"), so every layer runs on
[image shard; caption shard] and attends over every rank's image and caption (joint_last). The rotary rows
and the padding mask, which the forward builds for the whole sequence, keep this rank's image rows at each
block, and its caption rows (the rotary's) or every caption column (the mask, a key mask: PerToken then_text);
the caption refiner runs whole on every rank (its attention is the text's alone), and the final layer's image
rows are gathered.

PipeFusion cuts one stack, the image refiner's blocks then the main layers (as Flux's two lists), into stages, and
the image tokens into row bands; the padding tokens follow the last row, so they go with the last patch (its K/V
kept with it). A patch runs the refiner on its image tokens and the layers on [patch; caption], its image K/V
stale per patch and the caption's recomputed with every patch, its padding mask's caption columns whole. A stage
hands on the patch's image states, and the caption's too once its blocks reach the layers; a stage starting at
the first layer takes the image states alone and joins its own caption (the caption refiner runs whole on every
stage, it reads no image token). The last stage's final layer keeps the image rows; its prediction, one
[C, 1, H, W] per sample, is broadcast stacked.

diffusers' ZImagePipeline batches [positive; negative]; here the branches go [negative; positive], which cfg 2
splits. Its guidance is pos + g·(pos - neg) (not neg + g·(pos - neg)), applied where guidance_scale > 0, with
an optional rescale to the positive's norm (cfg_normalization) and no guidance after a step whose normalized
time exceeds cfg_truncation (both branches still run there, the positive's prediction taken alone).
ZImageImg2ImgPipeline (loaded with pipeline_class=) runs the schedule's last `strength` from the image's latents
noised to its first step. Not run here: the Omni pipeline (SigLIP image tokens joined [caption; image; SigLIP]),
the ControlNet and inpainting pipelines (load_pipeline names the ones it runs)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .adapter import FamilyAdapter, LatentLayout, PerToken
from .recipe import Recipe, RequestShape, generator_of, vae_scale
from .tiny_spec import INNER, TEXT_DIM, Part, TinySpec, flow_scheduler

SEQ_MULTI_OF = 32  # diffusers' transformer_z_image: image and caption tokens are each padded to a multiple of it


@dataclass(frozen=True)
class SampleLatents(LatentLayout):
    """Z-Image's x: a list of [C, F, H, W], one per sample, p × p pixels a token (its all_patch_size)."""

    name = "samples"

    def patch_size(self, model_config):
        return model_config["all_patch_size"][0]

    def token_grid(self, latents, model_config, arguments):
        sample = latents[0] if isinstance(latents, list) else latents
        return super().token_grid(sample, model_config, arguments)

    def padded_tokens(self, tokens, model_config):
        return -tokens % SEQ_MULTI_OF

    def prediction_shape(self, latents, model_config):
        """The predictions stacked, [B, C, F, H, W]: one per sample, each its sample's shape (out = in channels)."""
        return (len(latents), *latents[0].shape)


def caption_tokens(arguments) -> int:
    """The captions' tokens as the main layers take them (cap_feats: one [L_i, D] per sample): each padded to a
    multiple of 32, the batch to the longest."""
    return max(len(caption) + -len(caption) % SEQ_MULTI_OF for caption in arguments["cap_feats"])


def attention_shape(config) -> tuple[int, int]:
    """(heads, head_dim) as Z-Image's config spells them: n_heads, and dim split over them."""
    return config.get("n_heads"), config.get("dim") // config.get("n_heads")


_STACKS = ("noise_refiner", "context_refiner", "layers")  # image, caption, [image; caption]

ADAPTER = FamilyAdapter(
    "zimage",
    "ZImageTransformer2DModel",
    shard_at="noise_refiner.0",
    shard_at_input=True,
    gather_at="all_final_layer.2-1.linear",  # the one patch size (2, 1) the published models have
    text_after_image_at_gather=True,
    attention={
        r"^noise_refiner\.\d+\.attention$": "self",
        r"^context_refiner\.\d+\.attention$": "text",
        r"^layers\.\d+\.attention$": "joint_last",
    },
    latents=SampleLatents(),
    latents_argument="x",
    text_key_mask=True,
    text_len_at=r"^context_refiner\.\d+$",
    text_shard_at="joined",
    per_token=(
        PerToken(r"^noise_refiner\.\d+$", "freqs_cis"),
        PerToken(r"^noise_refiner\.\d+$", "attn_mask"),  # an image padding mask: refused by the attention
        PerToken(r"^layers\.\d+$", "freqs_cis", then_text="rows"),
        PerToken(r"^layers\.\d+$", "attn_mask", then_text="keys"),
    ),
    per_sample_lists=("x", "cap_feats"),
    # PipeFusion's stack: the image refiner's blocks, then the main layers, which take [image; caption] joined
    block_lists=("noise_refiner", "layers"),
    # tensor parallelism (diffusers declares no _tp_plan for Z-Image): each of its three stacks (the image's
    # refiner, the caption's, the joint layers) split alike: attention by heads (qk RMSNorms per head), the SwiGLU
    # MLP's w1, w3 by width and w2 by rows; the per-sample modulations [B, 4·dim] and the final layer's split and
    # gathered (an omni model's per-token modulation runs them twice a block: the closed form counts once)
    tp_plan={
        **{f"{stack}.*.attention.{p}": "colwise" for stack in _STACKS for p in ("to_q", "to_k", "to_v")},
        **{f"{stack}.*.attention.to_out.0": "rowwise" for stack in _STACKS},
        **{f"{stack}.*.feed_forward.{p}": "colwise" for stack in _STACKS for p in ("w1", "w3")},
        **{f"{stack}.*.feed_forward.w2": "rowwise" for stack in _STACKS},
    },
    tp_gathered=(
        "noise_refiner.*.adaLN_modulation.0",
        "layers.*.adaLN_modulation.0",
        "all_final_layer.2-1.adaLN_modulation.1",
    ),
    tp_tokens={r"context_refiner\..*": "whole_text", r"layers\..*": "joint"},  # the refiner: every rank's caption
    block_counts=("n_refiner_layers", "n_layers"),
    joined_block_lists=("layers",),
    joined_text_last=True,
    text_joined_at="layers.0",
    joint_text_len=caption_tokens,
    attention_shape=attention_shape,
    step_cache_refused="ZImageTransformer2DModel has no CacheMixin: diffusers' First-Block Cache, the reference it is "
    "checked against, does not run on it",
)


class ZImageRecipe(Recipe):
    pipeline_classes = ("ZImagePipeline", "ZImageImg2ImgPipeline")
    tasks = dict(ZImageImg2ImgPipeline="image to image")
    output_class = "diffusers.pipelines.z_image.pipeline_output:ZImagePipelineOutput"
    defaults = dict(num_inference_steps=50, guidance_scale=5.0)  # Z-Image-Turbo's folder: 8 to 9 steps, guidance 0
    # image and strength: image to image's (strength None: ZImageImg2ImgPipeline's default, 0.6)
    options = dict(max_sequence_length=512, cfg_normalization=False, cfg_truncation=1.0, image=None, strength=None)
    cfg_needs = "a guidance_scale above 0"
    counted_with = " in the chat template"
    padded_text = ("cap_feats",)  # each prompt's tokens, padded here to the batch's longest; cap_lengths says how many

    def do_cfg(self, request):
        return request.guidance_scale > 0  # ZImagePipeline's do_classifier_free_guidance

    def prompt_tokens(self, pipe, request, text):
        # the prompt in the chat template, as _encode_prompt tokenizes it before it truncates
        chat = pipe.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True, enable_thinking=True
        )
        return len(pipe.tokenizer(chat).input_ids)

    def size_multiple(self, pipe):
        return pipe.vae_scale_factor * 2, (1024, 1024)  # ZImagePipeline's default size

    def planned_default_size(self, configs):
        return 1024, 1024  # ZImagePipeline's, whatever the VAE

    def planned_multiple(self, configs):
        return vae_scale(configs["vae"])[0] * 2

    def check_inputs(self, pipe, request):
        multiple, name = self.size_multiple(pipe)[0], type(pipe).__name__
        for side_name, side in (("height", request.height), ("width", request.width)):
            if side is not None and side % multiple:
                raise ValueError(f"{side_name} must be a multiple of {multiple} for {name}, got {side}")
        image, strength = request.options["image"], request.options["strength"]
        if _from_image(pipe) and image is None:
            raise ValueError(f"{name} redraws an image: give image= (a PIL image)")
        if not _from_image(pipe) and (image is not None or strength is not None):
            raise ValueError(
                f"{name} draws from text alone and takes no image or strength; image to image is "
                f"ZImageImg2ImgPipeline's (load the folder with pipeline_class='ZImageImg2ImgPipeline')"
            )
        if strength is not None and not 0 <= strength <= 1:
            raise ValueError(f"strength must be between 0 and 1 (how much of the image is redrawn); got {strength}")

    def encode_texts(self, pipe, request, texts, device, *, negative):
        limit = request.options["max_sequence_length"]
        captions = pipe._encode_prompt(list(texts), device=device, max_sequence_length=limit)  # it edits the list
        lengths = torch.tensor([len(c) for c in captions], device=device)
        padded = captions[0].new_zeros((len(captions), int(lengths.max()), captions[0].shape[-1]))
        for row, caption in enumerate(captions):
            padded[row, : len(caption)] = caption
        return dict(cap_feats=padded, cap_lengths=lengths)

    def prepare(self, pipe, request, prepared, device):
        from diffusers.pipelines.z_image.pipeline_z_image import (
            calculate_shift,
            get_default_z_image_sigmas,
            retrieve_timesteps,
        )

        image = None
        if _from_image(pipe):  # the image's own size where the request gives none, as the pipeline takes it
            image = pipe.image_processor.preprocess(request.options["image"]).to(dtype=torch.float32)
        height = request.height or (image.shape[-2] if image is not None else 1024)
        width = request.width or (image.shape[-1] if image is not None else 1024)
        multiple = pipe.vae_scale_factor * 2
        rows, cols = height // multiple, width // multiple  # the image's tokens: 2 × 2 latent pixels each
        config = pipe.scheduler.config
        mu = calculate_shift(
            rows * cols,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
        steps = request.num_inference_steps
        sigmas = get_default_z_image_sigmas(steps)
        prepared.timesteps, _ = retrieve_timesteps(pipe.scheduler, steps, device, sigmas=sigmas, mu=mu)
        arguments = (len(request.prompts), pipe.transformer.in_channels, height, width)
        if image is None:
            pipe.scheduler.set_begin_index(0)
            prepared.latents = pipe.prepare_latents(*arguments, torch.float32, device, generator_of(request), None)
        else:  # image to image: the schedule's last `strength` of the steps, from the image's latents noised to the first
            strength = 0.6 if request.options["strength"] is None else request.options["strength"]
            prepared.timesteps, left = pipe.get_timesteps(steps, strength, device)
            if left < 1:
                raise ValueError(
                    f"strength {strength} of {steps} steps leaves no step to run; raise strength or num_inference_steps"
                )
            start = prepared.timesteps[:1].repeat(len(request.prompts))
            dtype = prepared.conditioning["cap_feats"].dtype  # the pipeline's: its prompt embeddings'
            latents = pipe.prepare_latents(image, start, *arguments, dtype, device, generator_of(request), None)
            prepared.latents = latents
        # read once here, not at every step (a step waits for nothing on the host): each caption's tokens, and each
        # step's normalized time, which cfg_truncation compares
        prepared.extra["caption_lengths"] = prepared.conditioning["cap_lengths"].tolist()
        prepared.extra["t_norms"] = ((1000 - prepared.timesteps.float()) / 1000).tolist()

    def planned_request(self, configs, call, element):
        """ZImagePipeline's text to image, as a rank keeps it between steps:

            latents     [prompts, in_channels, H / 8, W / 8]        float32, as the pipeline keeps them
            per row     [at most max_sequence_length, cap_feat_dim]  the prompt's unmasked Qwen3 states, padded
                        to the batch's longest, and its length (one int64)
        The image tokens are 2 × 2 latent pixels (rows × cols), padded by the transformer to a multiple of 32."""
        t, scale = configs["transformer"], vae_scale(configs["vae"])[0]
        height, width = call.height // scale, call.width // scale
        latents = t["in_channels"] * height * width * 4
        text = call.options["max_sequence_length"]
        per_row = text * t["cap_feat_dim"] * element + torch.int64.itemsize
        why = (
            f"conditioning: at most max_sequence_length {text} caption tokens a row; ZImagePipeline keeps a prompt's "
            f"own tokens, whose count is known only once it is tokenized"
        )
        return RequestShape(
            latents, per_row, 0, (height // 2, width // 2), (t["in_channels"], height, width), bounds=(why,)
        )

    def scale_model_input(self, pipe, model_input, t):
        return model_input.to(pipe.transformer.dtype)

    def model_kwargs(self, pipe, prepared, model_input, t):
        lengths = prepared.extra["caption_lengths"]
        captions = [row[:n] for row, n in zip(prepared.conditioning["cap_feats"], lengths)]
        timestep = (1000 - t.expand(model_input.shape[0])) / 1000
        return dict(x=list(model_input.unsqueeze(2).unbind(0)), t=timestep, cap_feats=captions, return_dict=False)

    def guide(self, pipe, prepared, noise, step_index):
        """ZImagePipeline's guidance on its list of predictions, negated for the scheduler as it does."""
        noise = torch.stack([n.float() for n in noise]).squeeze(2)
        if prepared.do_cfg:
            uncond, cond = noise.chunk(2)
            scale = self.guidance_at(pipe, prepared, step_index)
            noise = cond + scale * (cond - uncond) if scale > 0 else cond
            ceiling = float(prepared.extra["cfg_normalization"])
            if scale > 0 and ceiling > 0:  # each image's prediction no longer than the positive's × ceiling
                norms = torch.linalg.vector_norm(noise.flatten(1), dim=1)
                limit = torch.linalg.vector_norm(cond.flatten(1), dim=1) * ceiling
                factor = torch.where(norms > limit, limit / norms, torch.ones_like(norms))
                noise = noise * factor.view(-1, *[1] * (noise.dim() - 1))
        return -noise

    def guidance_at(self, pipe, prepared, step_index):
        """No guidance after the normalized time passes cfg_truncation (ZImagePipeline's)."""
        truncation = prepared.extra["cfg_truncation"]
        if truncation is not None and float(truncation) <= 1 and prepared.extra["t_norms"][step_index] > truncation:
            return 0.0
        return prepared.guidance_scale

    def encode(self, pipe, request, device, branch=None):
        prepared = super().encode(pipe, request, device, branch)
        prepared.extra.update(
            cfg_normalization=request.options["cfg_normalization"], cfg_truncation=request.options["cfg_truncation"]
        )
        return prepared

    def decoded(self, pipe, prepared, latents):
        latents = latents.to(pipe.vae.dtype) / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
        return pipe.vae.decode(latents, return_dict=False)[0]


RECIPE = ZImageRecipe()


def _from_image(pipe) -> bool:
    return type(pipe).__name__ == "ZImageImg2ImgPipeline"


def tiny_inputs(batch, height, width, text, timestep, randn):
    """Latents one [C, 1, H, W] per sample; captions of different lengths, every other one 32 tokens longer, so
    that the padded captions differ and the forward masks the shorter ones' padding."""
    captions = []
    for i in range(batch):
        caption = text[i, : text.shape[1] - i % 3]
        if i % 2:
            caption = torch.cat([caption, randn(SEQ_MULTI_OF, text.shape[2])])
        captions.append(caption)
    return dict(x=[randn(4, 1, height, width) for _ in range(batch)], t=timestep / 1000, cap_feats=captions)


TINY = TinySpec(  # STACK-FACTS' tiny ZImageTransformer2DModel: 3 heads of 16 (4 + 6 + 6 rotary)
    transformer=dict(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=INNER, n_refiner_layers=1,
        cap_feat_dim=TEXT_DIM, axes_dims=[4, 6, 6], axes_lens=[256, 32, 32],
    ),
    inputs=tiny_inputs,
    heads=3,
    size_names=dict(num_attention_heads=("n_heads", "n_kv_heads"), attention_head_dim=(), num_layers=("n_layers",)),
    pipeline_classes=("ZImagePipeline",),
    parts=dict(  # a Qwen3 text encoder; the VAE's latents scaled and shifted as Z-Image's (Flux's VAE)
        text_encoder=Part("qwen3_encoder", seed=1, vocab_of="tokenizer"),
        tokenizer=Part("qwen3_tokenizer"),
        vae=Part("image_vae", seed=2, kwargs=dict(latent_channels=4, scaling_factor=0.3611, shift_factor=0.1159)),
        scheduler=flow_scheduler(shift=3.0),
    ),
    # a 16 × 16 image: 8 × 8 latents, 4 × 4 tokens (padded to 32 by the transformer); the prompts' own tokens
    call=dict(height=16, width=16, max_sequence_length=64),
)  # fmt: skip
