"""HunyuanVideo-1.5: a Qwen2.5-VL text model (states before its last two layers, padded to 1000 tokens, masked)
and a ByT5 encoder of the prompt's quoted text (glyphs, padded to 256), video latents [B, C, F, H, W] with the
image condition's channels beside them (zeros and a zero mask for text to video), joint attention with the text
after the image, a token refiner over Qwen's text alone, CFG through the pipeline's guider, flow matching.

The forward joins its text itself, per sample, valid tokens first: [the image's embeddings (729 of them, all
masked for text to video); ByT5's; Qwen's], then the padding of each, zeroed. Every block takes that joint text
and its padding mask [B, T], from which its attention builds a query-and-key mask [B, 1, L, L] over the tokens it
holds. So the adapter reads the joint text's length from the forward's arguments (`joint_text_len`), and each
block takes this rank's share of the mask as of the text, the parallel kernels the whole of it as the text's key
mask (`text_mask_argument`). Padded text queries, which diffusers' mask leaves without a key, attend here; they
feed nothing that is not masked, and the forward returns the image's tokens alone: exact.

HunyuanVideo15ImageToVideoPipeline conditions on the image twice, both per sample (nothing moves under ulysses and
ring): SigLIP's embeddings of it are the joint text's first tokens, all valid, and its latents start the video on
the channels beside the noise, with a mask that marks frame 0 as given. It draws at the image's size bucket (the
model's target_size), the image resized and cropped to it; a MeanFlow model (use_meanflow) also takes the next
step's timestep (timestep_r):

    [noise C | image latents on frame 0, zeros after C | mask 1 on frame 0] --x_embedder--> tokens, cut by the shard
    SigLIP(image) [B, 729, 1152] --image_embedder--> the joint text's first tokens (both branches the same)

diffusers' pipelines run the guider's branches as separate forwards, conditional first; here both go
in one batch [negative; positive], which cfg 2 then splits, guided as its ClassifierFreeGuidance guides them
(uncond + scale × (cond − uncond)) with the call's guidance_scale. Every prompt's text has the same padded
lengths, so the branches need no padding to one length. Videos decode one at a time: diffusers 0.42.1's
AutoencoderKLHunyuanVideo15 cannot decode a batch of more than one (its mid-block attention's mask).

torch.compile (parallelize(..., compile=True)) runs it in three graphs, not one: diffusers' forward branches on
whether the image's embeddings are all zero (text to video), a jump on a tensor's value, and joins the text with
boolean masks of data-dependent length; tests/test_compile.py's one-graph check leaves the family out."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import torch

from .adapter import IMAGE_ONLY, VIDEO, FamilyAdapter
from .qwenimage import padded_text_mask
from .recipe import VideoRecipe, generator_of
from .tiny_spec import TEXT_DIM, Part, TinySpec, flow_scheduler

# HunyuanVideo15Pipeline's fixed lengths (its __init__): Qwen's text past the crop, ByT5's, the image's embeddings
QWEN_TOKENS, GLYPH_TOKENS, IMAGE_TOKENS = 1000, 256, 729
JOINED = ("image_embeds", "encoder_hidden_states_2", "encoder_hidden_states")  # the forward's order


def joint_text_len(arguments: dict) -> int:
    """The joint text the blocks take: the image's embeddings, ByT5's tokens and Qwen's, which the forward joins."""
    return sum(arguments[name].shape[1] for name in JOINED)


ADAPTER = FamilyAdapter(
    "hunyuanvideo15",
    "HunyuanVideo15Transformer3DModel",
    shard_at="x_embedder",
    attention={
        r"^transformer_blocks\.\d+\.attn$": "joint_last",
        r"^context_embedder\.token_refiner\.refiner_blocks\.\d+\.attn$": "text",
    },
    latents=VIDEO,
    rotary_at="rope",  # computed from the latents, before the tokens are sharded
    rotary=IMAGE_ONLY,
    text_key_mask=True,
    joint_text_len=joint_text_len,
    text_mask_argument="attention_mask",
    step_cache_refused="diffusers' First-Block Cache, the reference it is checked against, raises on it (its "
    "TransformerBlockRegistry does not list HunyuanVideo15TransformerBlock)",
    # diffusers' TransformerBlockRegistry does not list the block: it returns (image, text)
    block_returns={
        "HunyuanVideo15TransformerBlock": dict(return_hidden_states_index=0, return_encoder_hidden_states_index=1)
    },
    # tensor parallelism (diffusers declares no _tp_plan for it), as HunyuanVideo's double-stream blocks: image and
    # text attention split by heads (qk RMSNorms per head), both MLPs by width; the modulations [B, 6·dim] and the
    # output's split and gathered. The token refiner stays whole: it runs on the Qwen text alone, which the closed
    # form does not count apart from the ByT5 and image tokens joined to it
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


class HunyuanVideo15Recipe(VideoRecipe):
    pipeline_classes = ("HunyuanVideo15Pipeline", "HunyuanVideo15ImageToVideoPipeline")
    tasks = dict(HunyuanVideo15ImageToVideoPipeline="image to video")
    output_class = "diffusers.pipelines.hunyuan_video1_5.pipeline_output:HunyuanVideo15PipelineOutput"
    default_size = (480, 848)  # a 480p model's (target_size 640) at the pipeline's 16:9; drawn_size reads the model's
    # guidance_scale: the guider's scale (ClassifierFreeGuidance), 6 in HunyuanVideo-1.5's text-to-video folders;
    # a folder's own guider_config.json says it (folder_defaults)
    defaults = dict(num_inference_steps=50, guidance_scale=6.0)
    options = dict(num_frames=121, image=None)  # image: the first frame (image to video)
    image_inputs = (*VideoRecipe.image_inputs, "image_condition")  # the image's latents and mask (image to video)
    pipefusion_async_refused = dict.fromkeys(
        pipeline_classes,
        "the transformer takes the image condition's channels beside the latents (65 for 32), and the async schedule "
        "steps the scheduler patch by patch on the model input's layout; use the drained schedule (the default)",
    )
    bounded_tokenizer = "tokenizer"  # Qwen's, cut at 1000 tokens past the template's opening (ByT5's glyphs at 256)

    def folder_defaults(self, folder):
        """The folder's guider scale: diffusers' pipeline guides with it (its __call__ takes no guidance_scale), so a
        call without one here guides as diffusers would on that folder."""
        path = folder / "guider" / "guider_config.json"
        return {"guidance_scale": json.loads(path.read_text())["guidance_scale"]} if path.is_file() else {}

    def check_pipeline(self, pipe):
        from diffusers import ClassifierFreeGuidance

        guider = pipe.guider
        plain = dict(guidance_rescale=0.0, use_original_formulation=False, start=0.0, stop=1.0, enabled=True)
        changed = {key: guider.config.get(key) for key, value in plain.items() if guider.config.get(key) != value}
        if type(guider) is not ClassifierFreeGuidance or changed:
            raise ValueError(
                f"{type(pipe).__name__}'s guider is {type(guider).__name__}"
                f"{f' with {changed}' if changed else ''}; xdit_lab runs the plain ClassifierFreeGuidance (uncond + "
                f"scale × (cond − uncond) at every step): set pipe.guider = ClassifierFreeGuidance(guidance_scale=...)"
            )

    def check_inputs(self, pipe, request):
        name, image = type(pipe).__name__, request.options["image"]
        if not _takes_image(pipe):
            if image is not None:
                raise ValueError(
                    f"{name} draws from text alone and takes no image; image to video is "
                    f"HunyuanVideo15ImageToVideoPipeline's (an image-to-video folder)"
                )
            return
        if image is None or not hasattr(image, "convert"):
            raise ValueError(f"{name} draws a video from an image: give image= (a PIL image)")
        if request.height is not None or request.width is not None:
            raise ValueError(
                f"{name} draws at the image's size bucket (the model's target_size {pipe.target_size}), the image "
                f"resized and cropped to it, and takes no height or width: give neither"
            )

    def check_prompt_lengths(self, pipe, request):
        """Refuse, by name, a prompt the pipeline would cut without a word: Qwen reads tokenizer_max_length (1000)
        tokens past the chat template's opening it crops, ByT5 tokenizer_2_max_length (256) of the prompt's quoted
        text as the pipeline renders it (Text "...". ). The pipeline takes no max_sequence_length to raise either."""
        from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import extract_glyph_texts

        texts = [(f"prompt {i}", text) for i, text in enumerate(request.prompts)]
        texts += [(f"negative_prompt {i}", text) for i, text in enumerate(request.negatives or [])]
        for name, text in texts:
            tokens = self.prompt_tokens(pipe, request, text)
            if tokens > pipe.tokenizer_max_length:
                raise ValueError(
                    f"{name} is {tokens} tokens ({type(pipe.tokenizer).__name__}, past the chat template's opening "
                    f"the pipeline crops), more than the {pipe.tokenizer_max_length} {type(pipe).__name__} reads: it "
                    f"would cut the prompt and draw without the rest, without a warning. Shorten it to "
                    f"{pipe.tokenizer_max_length} tokens"
                )
            glyphs = extract_glyph_texts(text)
            glyph_tokens = 0 if glyphs is None else len(pipe.tokenizer_2(glyphs).input_ids)
            if glyph_tokens > pipe.tokenizer_2_max_length:
                raise ValueError(
                    f"{name}'s quoted text is {glyph_tokens} tokens ({type(pipe.tokenizer_2).__name__}, rendered as "
                    f'the pipeline renders it: Text "...". ), more than the {pipe.tokenizer_2_max_length} its glyph '
                    f"encoder reads: the pipeline would draw the text cut short, without a warning. Shorten the quoted "
                    f"text"
                )

    def prompt_tokens(self, pipe, request, text):
        # the prompt in the chat template, less the template's opening the pipeline crops (its closing tokens count)
        from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import format_text_input

        chat = format_text_input([text], pipe.system_message)
        ids = pipe.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)
        return len(ids["input_ids"][0]) - pipe.prompt_template_encode_start_idx

    def size_multiple(self, pipe):
        return pipe.vae_scale_factor_spatial * pipe.transformer.config.patch_size, self._default_size(pipe)

    def drawn_size(self, pipe, request):
        if _takes_image(pipe):  # the image's bucket
            image = request.options["image"]
            return pipe.video_processor.calculate_default_height_width(image.size[1], image.size[0], pipe.target_size)
        default = self._default_size(pipe)
        return request.height or default[0], request.width or default[1]

    @staticmethod
    def _default_size(pipe) -> tuple[int, int]:
        """The pipeline's size when none is given: the model's target_size at 16:9 (its image processor's bucket;
        HunyuanVideo15Pipeline's default_aspect_ratio)."""
        return pipe.video_processor.calculate_default_height_width(9, 16, pipe.target_size)

    def planned_default_size(self, configs):
        from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

        processor = HunyuanVideo15ImageProcessor(vae_scale_factor=configs["vae"].get("spatial_compression_ratio", 16))
        return processor.calculate_default_height_width(9, 16, configs["transformer"].get("target_size", 640))

    def encode_texts(self, pipe, request, texts, device, *, negative):
        dtype = pipe.transformer.dtype
        embeds, mask, glyphs, glyph_mask = pipe.encode_prompt(
            prompt=texts, device=device, dtype=dtype, batch_size=len(texts)
        )
        if _takes_image(pipe):  # SigLIP's of the resized image, the same for every row and branch
            image = pipe.encode_image(_resized(self, pipe, request), len(texts), device, dtype)
        else:  # zeros for text to video (the pipeline's), which the forward masks
            image = embeds.new_zeros(len(texts), pipe.vision_num_semantic_tokens, pipe.vision_states_dim)
        return dict(
            encoder_hidden_states=embeds,
            encoder_attention_mask=mask,
            encoder_hidden_states_2=glyphs,
            encoder_attention_mask_2=glyph_mask,
            image_embeds=image,
        )

    def prepare(self, pipe, request, prepared, device):
        from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import retrieve_timesteps

        steps = request.num_inference_steps
        sigmas = np.linspace(1.0, 0.0, steps + 1)[:-1]
        prepared.timesteps, _ = retrieve_timesteps(pipe.scheduler, steps, device, sigmas=sigmas)
        height, width = self.drawn_size(pipe, request)
        prepared.latents = pipe.prepare_latents(  # in the transformer's dtype, as the pipeline keeps them
            len(request.prompts), pipe.num_channels_latents, height, width, request.options["num_frames"],
            pipe.transformer.dtype, device, generator_of(request),
        )  # fmt: skip
        if _takes_image(pipe):  # the image's latents on frame 0 and the mask that marks it given (the pipeline's)
            condition, mask = pipe.prepare_cond_latents_and_mask(
                prepared.latents, _resized(self, pipe, request), len(request.prompts), height, width,
                pipe.transformer.dtype, device,
            )  # fmt: skip
            prepared.extra["image_condition"] = torch.cat([condition, mask], dim=1)

    def model_input(self, pipe, prepared, latents, t):
        # the image condition's latents and mask on the channels: zeros for text to video (the pipeline's)
        condition = prepared.extra.get("image_condition")
        if condition is None:
            condition = latents.new_zeros(latents.shape[0], latents.shape[1] + 1, *latents.shape[2:])
        condition = condition[: len(latents)]
        return super().model_input(pipe, prepared, torch.cat([latents, condition], dim=1), t)

    def model_kwargs(self, pipe, prepared, model_input, t):
        rows, dtype = model_input.shape[0], model_input.dtype
        arguments = dict(hidden_states=model_input, timestep=t.expand(rows).to(dtype), return_dict=False)
        if _takes_image(pipe) and pipe.transformer.config.use_meanflow:  # the next step's timestep, 0 after the last
            following = prepared.step_index + 1
            after = prepared.timesteps[following] if following < len(prepared.timesteps) else t.new_zeros(())
            arguments["timestep_r"] = after.expand(rows).to(dtype)
        return dict(arguments, **prepared.conditioning)

    def decoded(self, pipe, prepared, latents):
        # one video at a time: diffusers 0.42.1's AutoencoderKLHunyuanVideo15 masks its mid-block attention with a
        # [B, S, S] mask against [B, 1, S, S] weights, which a batch of more than one does not broadcast to
        latents = latents.to(pipe.vae.dtype) / pipe.vae.config.scaling_factor
        return torch.cat([pipe.vae.decode(latent[None], return_dict=False)[0] for latent in latents])

    def planned_request(self, configs, call, element):
        shape = super().planned_request(configs, call, element)
        encoder = configs.get("image_encoder")  # image to video: SigLIP's tokens, one per patch
        image = IMAGE_TOKENS if encoder is None else (encoder["image_size"] // encoder["patch_size"]) ** 2
        return dataclasses.replace(  # the latents in the model's dtype (VideoRecipe's pipelines keep float32)
            shape,
            latents_per_prompt=shape.latents_per_prompt // 4 * element,
            conditioning_per_row=self.planned_text_bytes(configs["transformer"], call, element, image),
        )

    def planned_text_bytes(self, transformer, call, element, image=IMAGE_TOKENS):
        # Qwen's states and mask, ByT5's states and mask (the masks in the model's dtype), the image's embeddings
        qwen = QWEN_TOKENS * (transformer["text_embed_dim"] + 1)
        glyphs = GLYPH_TOKENS * (transformer["text_embed_2_dim"] + 1)
        return (qwen + glyphs + image * transformer["image_embed_dim"]) * element


RECIPE = HunyuanVideo15Recipe()


def _takes_image(pipe) -> bool:
    return type(pipe).__name__ == "HunyuanVideo15ImageToVideoPipeline"


def _resized(recipe, pipe, request):
    """The request's image resized and cropped to the size drawn, as the image-to-video pipeline encodes it."""
    height, width = recipe.drawn_size(pipe, request)
    return pipe.video_processor.resize(request.options["image"], height=height, width=width, resize_mode="crop")


def tiny_inputs(batch, height, width, text, timestep, randn):
    """Two latent frames with the condition's channels; padded Qwen and ByT5 text, a different length per sample;
    the image's embeddings zero (text to video: the forward masks them)."""
    glyphs = randn(batch, 5, TEXT_DIM)
    return dict(
        hidden_states=randn(batch, 9, 2, height, width),
        encoder_hidden_states=text,
        encoder_attention_mask=padded_text_mask(batch, text.shape[1]).float(),
        encoder_hidden_states_2=glyphs,
        encoder_attention_mask_2=padded_text_mask(batch, glyphs.shape[1]).flip(0).float(),
        image_embeds=torch.zeros(batch, 7, 16),
        timestep=timestep,
    )


TINY = TinySpec(
    transformer=dict(
        in_channels=9, out_channels=4, num_refiner_layers=1, text_embed_dim=TEXT_DIM, text_embed_2_dim=TEXT_DIM,
        image_embed_dim=16, rope_axes_dim=(4, 6, 6), target_size=64,
    ),
    inputs=tiny_inputs,
    heads=3,  # uneven: Ulysses 2 splits them 2 + 1
    pipeline_classes=("HunyuanVideo15Pipeline", "HunyuanVideo15ImageToVideoPipeline"),
    parts=dict(  # Qwen2.5-VL's text model and ByT5 (T5's encoder over bytes)
        text_encoder=Part("qwen_vl_text_encoder", seed=1, vocab_of="tokenizer"),
        tokenizer=Part("qwen_chat_tokenizer"),
        text_encoder_2=Part("t5_encoder", seed=3, vocab_of="tokenizer_2"),
        tokenizer_2=Part("byt5_tokenizer"),
        vae=Part("hunyuan15_vae", seed=2, kwargs=dict(latent_channels=4)),
        scheduler=flow_scheduler(shift=5.0),
        guider=Part("ClassifierFreeGuidance", kwargs=dict(guidance_scale=6.0)),
    ),
    # image to video: SigLIP's vision tower, as wide as the transformer's image_embed_dim
    class_parts=dict(
        HunyuanVideo15ImageToVideoPipeline=dict(
            image_encoder=Part("siglip_vision_encoder", seed=5), feature_extractor=Part("siglip_image_processor")
        )
    ),
    # 2 latent frames of 4 × 4 (16x): 32 tokens; Qwen's text padded to 1000, ByT5's to 256, the image's 729 masked
    call=dict(height=64, width=64, num_frames=5),
)  # fmt: skip
