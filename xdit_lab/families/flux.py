"""Flux.1: CLIP pooled + T5 text, packed 2×2 latent tokens, joint attention with the text first (in the
double-stream blocks, and as one stream in the single-stream blocks), rotary tables over [text; image],
a guidance embedding, true CFG optional.

diffusers' FluxPipeline runs the negative prompt as a second forward (true CFG, when true_cfg_scale > 1
and a negative prompt is given); here both go in one batch [negative; positive], which cfg 2 then
splits over two ranks.

FluxImg2ImgPipeline (image to image) starts from the image's latents noised to the first of the last
`strength` of the steps, and runs those steps; FluxInpaintPipeline does the same, and after each step puts
back the image's latents, noised to the next step, where the mask is 0 (kept):

    latents = (1 - mask) * scale_noise(image latents, next t) + mask * stepped latents

FluxFillPipeline (inpainting with FLUX.1-Fill's transformer) starts as image to image, and feeds the
transformer the masked image's latents and the mask beside the latents, on the channels:

    [latents | masked image latents | mask] --transformer (in_channels 384 on FLUX.1-Fill)--> noise

FluxKontextPipeline (editing) appends the image's latents after the ones drawn, as one sequence whose ids
say which image a token is of (0: drawn, 1: the reference); the prediction keeps the drawn tokens:

    [latents; image latents] ids [(0, r, c); (1, r, c)] --transformer--> noise[:, :drawn tokens]

Sequence parallelism splits that sequence as any other; PipeFusion cuts both images into as many row bands,
patch i being band i of each (sharding.patch_layout: the grids read from the ids, adapter.PackedTokens), so the
reference's tokens are computed once, with stale K/V as the drawn ones; their ids follow the patches. The
transformer's call is otherwise FluxPipeline's.

FluxControlNetPipeline runs a ControlNet (FluxControlNetModel: Flux's blocks, fewer of them, and the control
image's packed latents added after x_embedder) before the transformer at every step, on the positive prompt;
its residuals, one [B, S, D] per block it feeds, are added to the transformer's image states, the same ones
for both true-CFG branches. The ControlNet is parallelized on the same mesh with the transformer's layout
(CONTROLNET_ADAPTER): it cuts the same batch rows and tokens, so its residuals are this rank's already and
the transformer takes them as they are (adapter.RankLocal), nothing gathered:

    rank r: ControlNet(x[rows_r, S/sp], control[rows_r, S/sp], text) --> residuals [rows_r, S/sp, D] per block
            transformer(x[rows_r, S/sp], ..., residuals)             --> its blocks add them to their states

Its attention moves what a Flux block's does (traffic.py counts its layers). The ControlNet's scale is
controlnet_conditioning_scale inside [control_guidance_start, control_guidance_end] of the steps, 0 outside
(where it still runs, as the pipeline runs it)."""

from __future__ import annotations

import inspect
import math

import torch

from .adapter import TOKENS, BlockResiduals, FamilyAdapter, PerToken, norm1_modulated
from .controlnet import CONTROLNET_OPTIONS, ControlNetRecipe, runs_controlnet
from .recipe import (
    PackedLatentsRecipe,
    RequestShape,
    TrueCFGRecipe,
    generator_of,
    prompt_embeds,
    shifted_vae_decoded,
)
from .tiny_spec import MAX_TOKENS, TEXT_DIM, Part, TinySpec, flow_scheduler, flow_vae, text_parts

# Flux.1's and Flux.2's transformers are cut alike: packed tokens sharded after x_embedder, the text first in
# the double-stream blocks and in the single-stream ones that follow, the ids without a batch dimension
FLUX_LAYOUT = dict(
    shard_at="x_embedder",
    attention={r"^(single_)?transformer_blocks\.\d+\.attn$": "joint_first"},
    latents=TOKENS,
    unbatched=("img_ids", "txt_ids"),
    block_lists=("transformer_blocks", "single_transformer_blocks"),
)


def _every_few_blocks(block: int, blocks: int, residuals: int, arguments: dict) -> int:
    """The residual FluxTransformer2DModel's forward adds at `block` of a list of `blocks`: the next one every
    ceil(blocks / residuals) blocks."""
    return block // math.ceil(blocks / residuals)


def _double_stream_residual(block: int, blocks: int, residuals: int, arguments: dict) -> int:
    """As _every_few_blocks, or in turn with controlnet_blocks_repeat (the double-stream blocks only)."""
    if arguments.get("controlnet_blocks_repeat"):
        return block % residuals
    return _every_few_blocks(block, blocks, residuals, arguments)


# The transformer's _cp_plan (families/cp_plan.py) cuts the text and its ids at the input, and the image's ids with
# the image tokens, so the rotary tables the forward makes of them hold this rank's rows already
ADAPTER = FamilyAdapter(
    "flux",
    "FluxTransformer2DModel",
    from_cp_plan=True,
    teacache=norm1_modulated,  # its first block's norm1(hidden_states, emb=temb) is TeaCache's modulated input
    # a ControlNet's residuals, [B, S, D] per block it feeds, added to the image states: cut with them (a
    # ControlNet parallelized on the same mesh hands them over cut already: RankLocal, taken as they are); under
    # PipeFusion each stage is given its own blocks' residuals
    per_token=(PerToken("", "controlnet_block_samples"), PerToken("", "controlnet_single_block_samples")),
    block_residuals=(
        BlockResiduals("controlnet_block_samples", "transformer_blocks", _double_stream_residual),
        BlockResiduals("controlnet_single_block_samples", "single_transformer_blocks", _every_few_blocks),
    ),
    # tensor parallelism: diffusers' _tp_plan, and the AdaLN modulations it leaves whole (27% of FLUX.1-dev)
    tp_gathered=(
        "transformer_blocks.*.norm1.linear",
        "transformer_blocks.*.norm1_context.linear",
        "single_transformer_blocks.*.norm.linear",
        "norm_out.linear",
    ),
    **FLUX_LAYOUT,
)

# the ControlNet: Flux's layout, its control image's packed latents [B, S, 64] cut with the tokens (they are
# added to x_embedder's output), no output gathered (its residuals stay this rank's)
CONTROLNET_ADAPTER = FamilyAdapter(
    "flux",
    "FluxControlNetModel",
    rotary_at="pos_embed",  # no _cp_plan: the text and its ids cut at the input, the rotary tables after
    text_shard_at="input",
    text_rows_kwarg="txt_ids",
    gather_at=None,
    per_token=(PerToken("", "controlnet_cond"),),
    **FLUX_LAYOUT,
)


class FluxRecipe(ControlNetRecipe, PackedLatentsRecipe, TrueCFGRecipe):
    pipeline_classes = (
        "FluxPipeline",
        "FluxImg2ImgPipeline",
        "FluxInpaintPipeline",
        "FluxFillPipeline",
        "FluxKontextPipeline",
        "FluxControlNetPipeline",
    )
    tasks = dict(
        FluxImg2ImgPipeline="image to image",
        FluxInpaintPipeline="inpainting",
        FluxFillPipeline="inpainting",
        FluxKontextPipeline="editing",
        FluxControlNetPipeline="ControlNet",
    )
    controlnet_model = "FluxControlNetModel"
    output_class = "diffusers.pipelines.flux.pipeline_output:FluxPipelineOutput"
    defaults = dict(num_inference_steps=28, guidance_scale=3.5)
    pipeline_defaults = dict(
        FluxImg2ImgPipeline=dict(guidance_scale=7.0),
        FluxInpaintPipeline=dict(guidance_scale=7.0),
        FluxFillPipeline=dict(num_inference_steps=50, guidance_scale=30.0),
        FluxControlNetPipeline=dict(guidance_scale=7.0),
    )
    # image, strength: FluxImg2ImgPipeline's and FluxInpaintPipeline's (strength None: the pipeline's own default);
    # mask_image (white: redrawn), padding_mask_crop: FluxInpaintPipeline's; max_area, _auto_resize: FluxKontextPipeline's
    # (None: its own defaults), where image is optional
    options = dict(
        true_cfg_scale=1.0,
        max_sequence_length=512,
        image=None,
        strength=None,
        mask_image=None,
        padding_mask_crop=None,
        max_area=None,
        _auto_resize=None,
        **CONTROLNET_OPTIONS,
    )
    bounded_tokenizer = "tokenizer_2"  # T5's; CLIP's pooled embedding reads its first 77 tokens
    longest_text = 512  # FluxPipeline.check_inputs

    unbatched_conditioning = ("txt_ids",)

    def encode_texts(self, pipe, request, texts, device, *, negative):
        embeds, pooled, text_ids = prompt_embeds(pipe, request, texts, device, prompt_2=None)
        return dict(encoder_hidden_states=embeds, pooled_projections=pooled, txt_ids=text_ids)

    def check_controlnet(self, pipe):
        if pipe.controlnet.input_hint_block is not None:
            raise NotImplementedError(
                "a Flux ControlNet with an input_hint_block (XLabs' layout: the control image in pixels, convolved "
                "in the forward, its residuals repeated over the blocks) is not run by xdit_lab yet; ControlNets "
                "that take the control image's packed latents (InstantX's, Shakker-Labs') are"
            )
        if pipe.controlnet.union:
            raise NotImplementedError(
                "a ControlNet-Union (its control mode joins the text as one more token inside its forward) is not "
                "run by xdit_lab yet; single-condition Flux ControlNets are"
            )

    def check_inputs(self, pipe, request):
        super().check_inputs(pipe, request)
        name, options = type(pipe).__name__, request.options
        if _fill(pipe) and request.negatives is not None:
            raise ValueError(f"{name} takes no negative_prompt: it runs one branch, guided by the model's input")
        takes, needs = PIPELINE_INPUTS[name]
        for key in needs:
            if options.get(key) is None:
                raise ValueError(f"{name} {NEEDED_FOR[key]}: give {key}= (a PIL image)")
        extra = [key for key in IMAGE_OPTIONS if options.get(key) is not None and key not in takes]
        if extra:
            raise ValueError(
                f"{name} takes no {' or '.join(extra)}; image to image is FluxImg2ImgPipeline's, inpainting "
                f"FluxInpaintPipeline's, editing FluxKontextPipeline's (load the folder with pipeline_class=...)"
            )
        strength = request.options.get("strength")
        if strength is not None and not 0 <= strength <= 1:
            raise ValueError(f"strength must be between 0 and 1 (how much of the image is redrawn); got {strength}")

    def prepare(self, pipe, request, prepared, device):
        if _kontext(pipe):
            self._prepare_kontext(pipe, request, prepared, device)
            return
        if not _image_to_image(pipe):
            generator = generator_of(request)  # one for the control image's latents and the noise, in that order
            if runs_controlnet(pipe):
                self._prepare_control(pipe, request, prepared, device, generator)
            latents = self.packed_latents(pipe, request, prepared, device, generator=generator)
            prepared.latents, prepared.conditioning["img_ids"] = latents
            tokens = prepared.latents.shape[1]
            self.set_timesteps(pipe, request, prepared, device, self.image_tokens_shift(pipe, tokens))
            return
        # FluxImg2ImgPipeline's and FluxInpaintPipeline's: the schedule's last `strength` of the steps, from the
        # image noised to their first
        default_height, default_width = self.size_multiple(pipe)[1]
        height, width = request.height or default_height, request.width or default_width
        prepared.extra["size"] = (height, width)
        options, crop = request.options, dict(crops_coords=None, resize_mode="default")
        if options["padding_mask_crop"] is not None:
            crop = dict(
                crops_coords=pipe.mask_processor.get_crop_region(
                    options["mask_image"], width, height, pad=options["padding_mask_crop"]
                ),
                resize_mode="fill",
            )
        image = pipe.image_processor.preprocess(options["image"], height=height, width=width, **crop)
        tokens = (height // pipe.vae_scale_factor // 2) * (width // pipe.vae_scale_factor // 2)
        self.set_timesteps(pipe, request, prepared, device, self.image_tokens_shift(pipe, tokens))
        strength = request.options["strength"]
        if strength is None:
            strength = inspect.signature(type(pipe).__call__).parameters["strength"].default
        prepared.timesteps, steps = pipe.get_timesteps(request.num_inference_steps, strength, device)
        if steps < 1:
            raise ValueError(
                f"strength {strength} of {request.num_inference_steps} steps leaves no step to run; "
                f"raise strength or num_inference_steps"
            )
        image, batch, generator = image.to(dtype=torch.float32), len(request.prompts), generator_of(request)
        channels = pipe.vae.config.latent_channels if _fill(pipe) else self.latent_channels(pipe)
        dtype = prepared.conditioning["encoder_hidden_states"].dtype
        latents = pipe.prepare_latents(
            image, prepared.timesteps[:1].repeat(batch), batch, channels, height, width, dtype, device, generator
        )
        if _fill(pipe):  # the masked image's latents and the mask, beside the latents on the channels
            prepared.latents, prepared.conditioning["img_ids"] = latents
            mask = pipe.mask_processor.preprocess(options["mask_image"], height=height, width=width)
            mask, masked = pipe.prepare_mask_latents(
                mask, (image * (1 - mask)).to(device=device, dtype=dtype), batch, pipe.vae.config.latent_channels, 1,
                *image.shape[-2:], dtype, device, generator,
            )  # fmt: skip
            prepared.extra["fill"] = torch.cat((masked, mask), dim=-1)
            return
        if not _inpaint(pipe):
            prepared.latents, prepared.conditioning["img_ids"] = latents
            return
        prepared.latents, noise, image_latents, prepared.conditioning["img_ids"] = latents
        mask = pipe.mask_processor.preprocess(options["mask_image"], height=height, width=width, **crop)
        mask, _ = pipe.prepare_mask_latents(
            mask, image * (mask < 0.5), batch, channels, 1, height, width, dtype, device, generator
        )
        prepared.extra["inpaint"] = (image_latents, mask, noise)

    def _prepare_control(self, pipe, request, prepared, device, generator):
        """FluxControlNetPipeline's: the control image at the request's size, its latents (sampled from the VAE
        with the request's generator, before the noise), shifted, scaled and packed as the latents are; and the
        ControlNet's scale at each step (0 outside control_guidance_start..end)."""
        from diffusers.pipelines.flux.pipeline_flux_controlnet import retrieve_latents

        default_height, default_width = self.size_multiple(pipe)[1]
        height, width = request.height or default_height, request.width or default_width
        batch, options = len(request.prompts), request.options
        image = pipe.prepare_image(
            image=options["control_image"], width=width, height=height, batch_size=batch, num_images_per_prompt=1,
            device=device, dtype=pipe.vae.dtype,
        )  # fmt: skip
        latents = retrieve_latents(pipe.vae.encode(image), generator=generator)
        latents = (latents - pipe.vae.config.shift_factor) * pipe.vae.config.scaling_factor
        channels = self.latent_channels(pipe)
        self.keep_control(prepared, request, pipe._pack_latents(latents, batch, channels, *latents.shape[2:]))

    def _prepare_kontext(self, pipe, request, prepared, device):
        """FluxKontextPipeline's: the size fit to max_area (its aspect ratio kept, multiples of the packed
        latent's pixels), the image resized (to the nearest preferred Kontext resolution, with _auto_resize) and
        its latents appended after the drawn ones, with ids whose first axis is 1."""
        options = _kontext_options(pipe, request)
        default_height, default_width = self.size_multiple(pipe)[1]
        height, width = request.height or default_height, request.width or default_width
        multiple, aspect = pipe.vae_scale_factor * 2, width / height
        width = round((options["max_area"] * aspect) ** 0.5) // multiple * multiple
        height = round((options["max_area"] / aspect) ** 0.5) // multiple * multiple
        prepared.extra["size"] = (height, width)
        image = request.options["image"]
        if image is not None:
            image_height, image_width = _kontext_image_size(pipe, request)
            image = pipe.image_processor.resize(image, image_height, image_width)
            image = pipe.image_processor.preprocess(image, image_height, image_width)
        prepared.latents, reference, ids, reference_ids = self.image_latents(
            pipe, request, prepared, device, height, width, image
        )
        prepared.conditioning["img_ids"] = ids if reference is None else torch.cat([ids, reference_ids], dim=0)
        if reference is not None:
            prepared.extra["reference"] = reference
        self.set_timesteps(pipe, request, prepared, device, self.image_tokens_shift(pipe, prepared.latents.shape[1]))

    def appended_grids(self, pipe, request):
        """Kontext's reference image, a grid of packed tokens after the drawn ones."""
        if not _kontext(pipe) or request.options["image"] is None:
            return ()
        multiple = pipe.vae_scale_factor * 2
        return (tuple(side // multiple for side in _kontext_image_size(pipe, request)),)

    def controlnet_kwargs(self, pipe, prepared, model_input, kwargs, control, scale):
        # the ControlNet on the positive prompt, in every row the transformer runs (both branches take its
        # residuals); parallelized like the transformer, so its residuals come cut as the transformer cuts (under
        # PipeFusion whole, and each stage takes its own blocks')
        rows, branches = model_input.shape[0], 2 if prepared.do_cfg else 1
        positive = {
            key: torch.cat([kwargs[key].chunk(branches)[-1]] * branches)
            for key in ("encoder_hidden_states", "pooled_projections")
        }
        distilled = prepared.extra["distilled_guidance"]
        guidance = torch.full([rows], distilled, device=model_input.device, dtype=torch.float32)
        blocks, single_blocks = pipe.controlnet(
            hidden_states=model_input,
            controlnet_cond=control.repeat(rows // len(control), 1, 1).to(model_input.dtype),
            conditioning_scale=scale,
            timestep=kwargs["timestep"],
            guidance=guidance if pipe.controlnet.config.guidance_embeds else None,
            txt_ids=kwargs["txt_ids"],
            img_ids=kwargs["img_ids"],
            return_dict=False,
            **positive,
        )
        return dict(controlnet_block_samples=blocks, controlnet_single_block_samples=single_blocks)

    def model_input(self, pipe, prepared, latents, t):
        if "fill" in prepared.extra:  # FluxFillPipeline's: the masked image and the mask beside the latents
            latents = torch.cat((latents, prepared.extra["fill"]), dim=2)
        return super().model_input(pipe, prepared, latents, t)

    def scheduler_step(self, pipe, prepared, noise, t, latents, step_index):
        latents = super().scheduler_step(pipe, prepared, noise, t, latents, step_index)
        if "inpaint" not in prepared.extra:
            return latents
        image_latents, mask, first_noise = prepared.extra["inpaint"]  # FluxInpaintPipeline's, after each step
        if step_index < len(prepared.timesteps) - 1:
            next_t = torch.tensor([prepared.timesteps[step_index + 1]])
            image_latents = pipe.scheduler.scale_noise(image_latents, next_t, first_noise)
        return (1 - mask) * image_latents + mask * latents

    def planned_request(self, configs, call, element):
        t = configs["transformer"]
        rows, cols, latents = self.packed_grid(configs, call, element)
        text = call.options["max_sequence_length"]
        per_row = text * t["joint_attention_dim"] * element + t["pooled_projection_dim"] * element
        shared = text * 3 * element + rows * cols * 3 * element  # txt_ids and img_ids [tokens, 3], in the text's dtype
        channels = configs["vae"]["latent_channels"]
        return RequestShape(latents, per_row, shared, (rows, cols), (channels, 2 * rows, 2 * cols))

    def decoded(self, pipe, prepared, latents):
        height, width = prepared.extra["size"]
        return shifted_vae_decoded(pipe, pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor))


RECIPE = FluxRecipe()

# what each pipeline takes of the image options, and which of them it needs
PIPELINE_INPUTS = {
    "FluxPipeline": ((), ()),
    "FluxImg2ImgPipeline": (("image", "strength"), ("image",)),
    "FluxInpaintPipeline": (("image", "strength", "mask_image", "padding_mask_crop"), ("image", "mask_image")),
    "FluxFillPipeline": (("image", "strength", "mask_image"), ("image", "mask_image")),
    "FluxKontextPipeline": (("image", "max_area", "_auto_resize"), ()),
    "FluxControlNetPipeline": ((), ()),  # its control image: controlnet.check_controlnet_options
}
IMAGE_OPTIONS = ("image", "strength", "mask_image", "padding_mask_crop", "max_area", "_auto_resize")
NEEDED_FOR = {"image": "draws from an image", "mask_image": "redraws where its mask is white"}


def _image_to_image(pipe) -> bool:
    """A pipeline that starts from an image: image to image, or inpainting."""
    return type(pipe).__name__ in ("FluxImg2ImgPipeline", "FluxInpaintPipeline", "FluxFillPipeline")


def _fill(pipe) -> bool:
    return type(pipe).__name__ == "FluxFillPipeline"


def _kontext(pipe) -> bool:
    return type(pipe).__name__ == "FluxKontextPipeline"


def _kontext_options(pipe, request) -> dict:
    """max_area and _auto_resize as the request gives them, or FluxKontextPipeline's defaults."""
    defaults = inspect.signature(type(pipe).__call__).parameters
    return {
        key: defaults[key].default if request.options[key] is None else request.options[key]
        for key in ("max_area", "_auto_resize")
    }


def _kontext_image_size(pipe, request) -> tuple[int, int]:
    """(height, width) FluxKontextPipeline resizes its image to: its own (or, with _auto_resize, the preferred
    Kontext resolution nearest its aspect ratio), cut to multiples of the packed latent's pixels."""
    from diffusers.pipelines.flux.pipeline_flux_kontext import PREFERRED_KONTEXT_RESOLUTIONS

    image, multiple = request.options["image"], pipe.vae_scale_factor * 2
    height, width = pipe.image_processor.get_default_height_width(image[0] if isinstance(image, list) else image)
    if _kontext_options(pipe, request)["_auto_resize"]:
        _, width, height = min((abs(width / height - w / h), w, h) for w, h in PREFERRED_KONTEXT_RESOLUTIONS)
    return height // multiple * multiple, width // multiple * multiple


def _inpaint(pipe) -> bool:
    return type(pipe).__name__ == "FluxInpaintPipeline"


def packed_inputs(batch, height, width, text, timestep, randn, *, axes: int) -> dict:
    """Packed tokens and their ids per token, (0, row, column) (Flux.2's with a 4th axis; text: its index)."""

    grid = torch.meshgrid(
        torch.zeros(1),
        torch.arange(float(height)),
        torch.arange(float(width)),
        *[torch.zeros(1)] * (axes - 3),
        indexing="ij",
    )
    txt_ids = torch.zeros(text.shape[1], axes)
    txt_ids[:, 3:] = torch.arange(float(text.shape[1]))[:, None]
    img_ids = torch.stack(grid, dim=-1).reshape(height * width, axes)
    return dict(
        hidden_states=randn(batch, height * width, 16), encoder_hidden_states=text, img_ids=img_ids, txt_ids=txt_ids
    )


def tiny_inputs(batch, height, width, text, timestep, randn):
    inputs = packed_inputs(batch, height, width, text, timestep, randn, axes=3)
    return dict(inputs, pooled_projections=randn(batch, TEXT_DIM), timestep=timestep / 1000)


# Flux.1's and Flux.2's scheduler: flow matching with a shift that grows with the image's tokens
FLUX_SCHEDULER = flow_scheduler(shift=3.0, max_shift=1.15, max_image_seq_len=4096)

TINY = TinySpec(  # 2 × 2 patches of 16 latent channels packed into 64
    transformer=dict(
        patch_size=1, in_channels=16, num_single_layers=2, joint_attention_dim=TEXT_DIM,
        pooled_projection_dim=TEXT_DIM, guidance_embeds=False, axes_dims_rope=(4, 6, 6),
    ),
    inputs=tiny_inputs,
    pipeline_classes=("FluxPipeline",),
    parts=dict(
        transformer=Part("transformer", kwargs=dict(in_channels=64)),
        **text_parts("clip", seed=3, width=TEXT_DIM, projection=False),
        **text_parts("t5", seed=1, component="_2"),
        vae=flow_vae(scaling_factor=0.3611, shift_factor=0.1159),
        scheduler=FLUX_SCHEDULER,
    ),
    call=dict(height=16, width=16, max_sequence_length=MAX_TOKENS),
)  # fmt: skip
