"""HunyuanVideo: Llama states (padded to max_sequence_length, masked) and CLIP's pooled embedding,
video latents [B, C, F, H, W], joint attention with the text after the image (masked padding), a token
refiner over the text alone, guidance-distilled, flow matching.

diffusers' HunyuanVideoPipeline runs the negative prompt as a second forward (true CFG, when
true_cfg_scale > 1 and a negative prompt is given); here both go in one batch [negative; positive],
which cfg 2 then splits. Every prompt's text is padded to the same max_sequence_length.

HunyuanVideoImageToVideoPipeline (HunyuanVideo-I2V) conditions on the image twice: Llava sees it in the prompt's
template, and its image tokens (every `image_embed_interleave`-th) go before the text; its latents start the video:

    token_replace (HunyuanVideo-I2V's transformer): frame 0 is the image's latents at every step, its tokens
        modulated at t = 0 (a count of the leading tokens, cut with the shard: adapter.PerToken prefix)
    latent_concat: [noise | image latents on frame 0 | mask] on the channels; the first 4 decoded frames dropped

The negative branch encodes a black image at the video's size with encode_prompt's default interleave (2), as the
pipeline does: its text can be longer than the positive's, so the branches are padded to one length with the mask
(padded_text), which the masked attention makes exact."""

from __future__ import annotations

import inspect

import numpy as np
import torch

from .adapter import IMAGE_ONLY, VIDEO, FamilyAdapter, PerToken, norm1_modulated
from .qwenimage import padded_text_mask
from .recipe import TrueCFGRecipe, VideoRecipe
from .tiny_spec import MAX_TOKENS, TEXT_DIM, Part, TinySpec, flow_scheduler, text_parts


def teacache_input(block, argument) -> torch.Tensor:
    """TeaCache's modulated input of HunyuanVideo's first double-stream block: norm1(hidden_states, emb=temb)'s
    states, or with token replace (HunyuanVideo-I2V) its norm1 as the block calls it, the first frame's tokens (this
    rank's share of num_tokens) modulated at t = 0."""
    if "token_replace_emb" in inspect.signature(type(block).forward).parameters:
        hidden, temb = argument("hidden_states"), argument("temb")
        return block.norm1(hidden, temb, argument("token_replace_emb"), argument("num_tokens"))[0]
    return norm1_modulated(block, argument)


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
    # tensor parallelism (diffusers declares no _tp_plan for HunyuanVideo), as Flux's: the double-stream blocks'
    # image and text attention split by heads (their qk RMSNorms are per head) and both MLPs by width; the
    # single-stream blocks' q, k, v and MLP split, their proj_out over [attention; MLP] cut block by block. The
    # blocks' modulations [B, 6·dim] and [B, 3·dim] and the output's split and gathered. The token refiner (over the
    # text alone) the same way, its gates [B, 2·dim] gathered
    tp_plan={
        **{f"context_embedder.token_refiner.refiner_blocks.*.attn.{p}": "colwise" for p in ("to_q", "to_k", "to_v")},
        "context_embedder.token_refiner.refiner_blocks.*.attn.to_out.0": "rowwise",
        "context_embedder.token_refiner.refiner_blocks.*.ff.net.0.proj": "colwise",
        "context_embedder.token_refiner.refiner_blocks.*.ff.net.2": "rowwise",
        **{f"transformer_blocks.*.attn.{p}": "colwise" for p in ("to_q", "to_k", "to_v")},
        **{f"transformer_blocks.*.attn.{p}": "colwise" for p in ("add_q_proj", "add_k_proj", "add_v_proj")},
        "transformer_blocks.*.attn.to_out.0": "rowwise",
        "transformer_blocks.*.attn.to_add_out": "rowwise",
        **{f"transformer_blocks.*.{ff}.net.0.proj": "colwise" for ff in ("ff", "ff_context")},
        **{f"transformer_blocks.*.{ff}.net.2": "rowwise" for ff in ("ff", "ff_context")},
        **{f"single_transformer_blocks.*.attn.{p}": "colwise" for p in ("to_q", "to_k", "to_v")},
        "single_transformer_blocks.*.proj_mlp": "colwise",
        "single_transformer_blocks.*.proj_out": "packed-rowwise",  # [attention (dim); MLP]
    },
    tp_gathered=(
        "transformer_blocks.*.norm1.linear",
        "transformer_blocks.*.norm1_context.linear",
        "single_transformer_blocks.*.norm.linear",
        "context_embedder.token_refiner.refiner_blocks.*.norm_out.linear",
        "norm_out.linear",
    ),
    teacache=teacache_input,
)


class HunyuanVideoRecipe(VideoRecipe, TrueCFGRecipe):
    pipeline_classes = ("HunyuanVideoPipeline", "HunyuanVideoImageToVideoPipeline")
    tasks = dict(HunyuanVideoImageToVideoPipeline="image to video")
    output_class = "diffusers.pipelines.hunyuan_video.pipeline_output:HunyuanVideoPipelineOutput"
    default_size = (720, 1280)  # HunyuanVideoPipeline's (and its image-to-video pipeline's)
    defaults = dict(num_inference_steps=50, guidance_scale=6.0)  # the distilled guidance, an input
    pipeline_defaults = dict(HunyuanVideoImageToVideoPipeline=dict(guidance_scale=1.0))
    # prompt_template None: the pipeline class's own (diffusers' DEFAULT_PROMPT_TEMPLATE of its module); image and
    # image_embed_interleave: the image to video's (None: the pipeline's default for its image_condition_type)
    options = dict(
        true_cfg_scale=1.0, num_frames=129, max_sequence_length=256, prompt_template=None, image=None,
        image_embed_interleave=None,
    )  # fmt: skip
    image_inputs = (*VideoRecipe.image_inputs, "image_condition")
    # the negative branch's text can be longer than the positive's (image to video): both padded to one length
    padded_text = ("encoder_hidden_states", "encoder_attention_mask")
    counted_with = " with the template's closing tokens"

    def prompt_tokens(self, pipe, request, text):
        # Llama's tokens of the prompt in its template, less the template's opening the pipeline crops
        template = _template(pipe, request)
        crop = template.get("crop_start")
        if crop is None:  # as the pipeline's _get_llama_prompt_embeds counts it
            crop = pipe.tokenizer(template["template"], padding="max_length", return_tensors="pt").input_ids.shape[-1]
            crop -= 5 if _takes_image(pipe) else 2  # the closing tokens and the {} placeholder it does not count
        return len(pipe.tokenizer(template["template"].format(text)).input_ids) - crop

    def check_inputs(self, pipe, request):
        image, condition = request.options["image"], pipe.transformer.config.image_condition_type
        if _takes_image(pipe) and image is None:
            raise ValueError(f"{type(pipe).__name__} draws a video from an image: give image= (a PIL image)")
        if _takes_image(pipe) and condition not in ("token_replace", "latent_concat"):
            raise ValueError(
                f"{type(pipe).__name__} needs a transformer with image_condition_type token_replace or latent_concat "
                f"(HunyuanVideo-I2V's); this one has {condition!r}: load an image-to-video folder"
            )
        if not _takes_image(pipe) and image is not None:
            raise ValueError(
                f"{type(pipe).__name__} draws from text alone and takes no image; image to video is "
                f"HunyuanVideoImageToVideoPipeline's (a HunyuanVideo-I2V folder)"
            )
        if not _takes_image(pipe) and request.options["image_embed_interleave"] is not None:
            raise ValueError(f"{type(pipe).__name__} takes no image_embed_interleave (an image to video's argument)")

    def encode_texts(self, pipe, request, texts, device, *, negative):
        arguments = dict(
            prompt=texts,
            prompt_template=_template(pipe, request),
            device=device,
            max_sequence_length=request.options["max_sequence_length"],
        )
        if _takes_image(pipe):  # Llava sees the image in every prompt's template (the pipeline takes one per prompt)
            if negative:  # a black image at the video's size, and encode_prompt's default interleave: the pipeline's
                from PIL import Image

                height, width = self.size(request)
                arguments["image"] = [Image.new("RGB", (width, height), 0)] * len(texts)
            else:
                arguments["image"] = [request.options["image"]] * len(texts)
                arguments["image_embed_interleave"] = _interleave(pipe, request)
        embeds, pooled, mask = pipe.encode_prompt(**arguments)
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
        if not _takes_image(pipe):
            pipe.scheduler.set_begin_index(0)  # HunyuanVideoPipeline's (its image-to-video pipeline does not)
            prepared.latents = self.video_latents(pipe, request, device)
            return
        # the pipeline's: the noise drawn and moved 0.1% toward the image's latents (on every frame); token
        # replace keeps the image's latents as frame 0, latent concat feeds them on frame 0 with a mask
        height, width = self.size(request)
        image = pipe.video_processor.preprocess(request.options["image"], height, width).to(device, pipe.vae.dtype)
        condition = pipe.transformer.config.image_condition_type
        config = pipe.transformer.config
        channels = (config.in_channels - 1) // 2 if condition == "latent_concat" else config.in_channels
        image = image.expand(len(request.prompts), -1, -1, -1)
        prepared.latents, image_latents = self.video_latents(
            pipe, request, device, image, channels=channels, after=(None, condition)
        )
        if condition == "token_replace":
            prepared.extra["first_frame"] = image_latents
        else:
            image_latents[:, :, 1:] = 0
            mask = image_latents.new_zeros(image_latents.shape[0], 1, *image_latents.shape[2:])
            mask[:, :, 0] = 1
            prepared.extra["image_condition"] = torch.cat([image_latents, mask], dim=1)

    def model_input(self, pipe, prepared, latents, t):
        first_frame, condition = prepared.extra.get("first_frame"), prepared.extra.get("image_condition")
        if first_frame is not None:
            latents = torch.cat([first_frame[: len(latents)], latents[:, :, 1:]], dim=2)
        elif condition is not None:
            latents = torch.cat([latents, condition[: len(latents)]], dim=1)
        return super().model_input(pipe, prepared, latents, t)

    def scheduler_step(self, pipe, prepared, noise, t, latents, step_index):
        first_frame = prepared.extra.get("first_frame")
        if first_frame is None:
            return super().scheduler_step(pipe, prepared, noise, t, latents, step_index)
        # token replace: frames 1.. stepped, frame 0 the image's latents again (the pipeline's)
        stepped = super().scheduler_step(pipe, prepared, noise[:, :, 1:], t, latents[:, :, 1:], step_index)
        return torch.cat([first_frame[: len(latents)], stepped], dim=2)

    def planned_text_bytes(self, transformer, call, element):
        # Llama's states padded to max_sequence_length with a mask in the model's dtype, and CLIP's pooled embedding;
        # image to video: the template's closing tokens cropped, the image's tokens put before the text, and both
        # branches padded to the longer (the negative's, at encode_prompt's default interleave)
        text = call.options["max_sequence_length"]
        condition = transformer.get("image_condition_type")
        if condition is not None:
            from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video_image2video import DEFAULT_PROMPT_TEMPLATE

            template = call.options.get("prompt_template") or DEFAULT_PROMPT_TEMPLATE
            image = template.get("image_emb_len", 576)
            interleaves = [call.options.get("image_embed_interleave") or _INTERLEAVE.get(condition, 1)]
            interleaves += [2] * (call.branches == 2)  # encode_prompt's default, the negative's
            text += max(-(-image // k) if 0 < k < 6 else image for k in interleaves) - 4
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

    def decode(self, pipe, prepared, latents, output_type):
        if prepared.extra.get("image_condition") is not None and output_type == "latent":
            return latents[:, :, 1:]  # latent concat: the pipeline returns the frames after the image's
        return super().decode(pipe, prepared, latents, output_type)

    def decoded(self, pipe, prepared, latents):
        video = pipe.vae.decode(latents.to(pipe.vae.dtype) / pipe.vae.config.scaling_factor, return_dict=False)[0]
        if prepared.extra.get("image_condition") is not None:
            return video[:, :, 4:]  # latent concat: the pipeline drops the first 4 frames (the image's)
        return video


RECIPE = HunyuanVideoRecipe()

# image_embed_interleave's default per image_condition_type: HunyuanVideoImageToVideoPipeline.__call__'s
_INTERLEAVE = dict(latent_concat=2, token_replace=4)


def _takes_image(pipe) -> bool:
    return type(pipe).__name__ == "HunyuanVideoImageToVideoPipeline"


def _template(pipe, request) -> dict:
    """The call's prompt_template, else the pipeline's own (its module's DEFAULT_PROMPT_TEMPLATE)."""
    import importlib

    given = request.options["prompt_template"]
    return given if given is not None else importlib.import_module(type(pipe).__module__).DEFAULT_PROMPT_TEMPLATE


def _interleave(pipe, request) -> int:
    given = request.options["image_embed_interleave"]
    return given if given is not None else _INTERLEAVE.get(pipe.transformer.config.image_condition_type, 1)


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
