"""Qwen-Image: a Qwen2.5-VL text encoder, packed 2×2 latent tokens, joint attention with the text first
over padded text (masked), true CFG with a norm-preserving rescale, flow matching.

diffusers' QwenImagePipeline encodes the prompts and the negative prompts apart, each padded to its
own longest prompt with a mask (None when nothing is padded), and runs the negative branch as a
second forward. Here both branches go in one batch [negative; positive], which cfg 2 then splits:
their text is padded to one length with the mask extended (`padded_text`), which the transformer's
masked attention makes exact, and the session pads every rank's rows to the longest over the ranks
before it gathers them. The parallel kernels take the mask as a key mask over the text alone.

Editing (QwenImageEditPipeline, Qwen-Image-Edit's: one image; QwenImageEditPlusPipeline, 2509's and 2511's:
several): the image goes twice into the call. Qwen2.5-VL reads the prompt with the image in it (its processor
expands the image into vision tokens; Plus names each image "Picture n:" and shows it at 384² pixels), and the
VAE encodes it at 1024² pixels, whatever size is drawn; its packed tokens follow the drawn ones in one sequence,
img_shapes lists one (frames, rows, cols) per image, and the prediction keeps the drawn tokens:

    [latents; image 1 tokens; image 2 tokens ...]  img_shapes [(1, h, w), (1, h1, w1), ...]  -> noise[:, :h·w]

Sequence parallelism splits that sequence as any other, and 2511's zero_cond_t (the references' tokens
modulated at t = 0, modulate_index) follows the tokens' shard, as the transformer's _cp_plan says. PipeFusion
cuts every image of the sequence into as many row bands (sharding.patch_layout: `appended_grids`), patch i
being band i of each, so the references' tokens are computed once, with stale K/V as the drawn ones, and every
patch's share of each is balanced; their rotary rows and modulate_index follow the patches, and the output
holds every image's tokens, as the transformer returns them (guide keeps the drawn ones):

    patch 0: drawn rows 0..h/2, image 1 rows 0..h1/2, ...   patch 1: the other halves

Every prompt of a call edits the same image(s), each prompt encoded with them apart (diffusers' Plus pipeline
takes one prompt a call), padded to the longest and masked as the branches are."""

from __future__ import annotations

import torch

from .adapter import IMAGE_AND_TEXT, TOKENS, FamilyAdapter
from .recipe import (
    PackedLatentsRecipe,
    RequestShape,
    TrueCFGRecipe,
    causal_vae_decoded,
    pad_text,
    prompt_embeds,
)
from .tiny_spec import TEXT_DIM, Part, TinySpec, flow_scheduler


def teacache_input(block, argument) -> torch.Tensor:
    """TeaCache's modulated input of a QwenImageTransformerBlock: img_norm1(hidden_states) modulated by the first
    half of img_mod(temb) (shift and scale; per token by modulate_index where the forward gives one), what its
    image stream's attention takes."""
    modulation = block.img_mod(argument("temb")).chunk(2, dim=-1)[0]
    return block._modulate(block.img_norm1(argument("hidden_states")), modulation, argument("modulate_index"))[0]


ADAPTER = FamilyAdapter(
    "qwenimage",
    "QwenImageTransformer2DModel",
    shard_at="img_in",
    attention={r"^transformer_blocks\.\d+\.attn$": "joint_first"},
    latents=TOKENS,
    rotary=IMAGE_AND_TEXT,
    # from its _cp_plan (cp_plan.py): the rotary tables at pos_embed, the text and its key mask as block 0 takes
    # them, and Qwen-Image-Edit-2511's modulate_index (zero_cond_t: which image of the sample each token is of),
    # built whole by the forward and handed to every block, cut with the tokens
    from_cp_plan=True,
    per_sample_lists=("img_shapes",),
    # tensor parallelism: diffusers' _tp_plan, and the modulations it leaves whole
    tp_gathered=("transformer_blocks.*.img_mod.1", "transformer_blocks.*.txt_mod.1", "norm_out.linear"),
    teacache=teacache_input,
)


EDIT_PIPELINES = ("QwenImageEditPipeline", "QwenImageEditPlusPipeline")


class QwenImageRecipe(PackedLatentsRecipe, TrueCFGRecipe):
    pipeline_classes = ("QwenImagePipeline", *EDIT_PIPELINES)
    tasks = dict.fromkeys(EDIT_PIPELINES, "editing")
    output_class = "diffusers.pipelines.qwenimage.pipeline_output:QwenImagePipelineOutput"
    defaults = dict(num_inference_steps=50, guidance_scale=None)  # guidance_scale: a distilled model's input
    options = dict(true_cfg_scale=4.0, max_sequence_length=512, image=None)  # image: the edit pipelines'
    longest_text = 1024  # QwenImagePipeline.check_inputs
    counted_with = " with the template's closing tokens"

    def check_inputs(self, pipe, request):
        name, image = type(pipe).__name__, request.options["image"]
        if not _edits(pipe):
            if image is not None:
                raise ValueError(
                    f"{name} draws from text alone and takes no image; editing is QwenImageEditPipeline's (one image) "
                    f"and QwenImageEditPlusPipeline's (several): load an edit model's folder"
                )
            return
        images = image if isinstance(image, list) else [image]
        if image is None or not images:
            raise ValueError(f"{name} edits an image: give image= ({_IMAGE_TAKEN[name]})")
        if name == "QwenImageEditPipeline" and isinstance(image, list):
            # diffusers' pipeline reads a list as one image per prompt, and leaves such images unresized for its
            # processor: here every prompt edits the one image given, as diffusers' call with one prompt does
            raise ValueError(
                f"QwenImageEditPipeline edits one image, and every prompt edits it: give image= one PIL image, not a "
                f"list of {len(image)} (several reference images are QwenImageEditPlusPipeline's, Qwen-Image-Edit-2509)"
            )
        if any(not hasattr(picture, "convert") for picture in images):  # the PIL images the processor reads
            raise ValueError(f"{name} takes image= as {_IMAGE_TAKEN[name]}; got {type(images[0]).__name__}")

    def token_budget(self, pipe, request):
        # the edit pipelines never cut a prompt (max_sequence_length goes unused): there is nothing to refuse
        return None if _edits(pipe) else super().token_budget(pipe, request)

    def prompt_tokens(self, pipe, request, text):
        # the prompt in its template, less the template's opening the pipeline crops (its closing tokens count)
        ids = pipe.tokenizer(pipe.prompt_template_encode.format(text)).input_ids
        return len(ids) - pipe.prompt_template_encode_start_idx

    padded_text = ("encoder_hidden_states", "encoder_hidden_states_mask")

    def encode_texts(self, pipe, request, texts, device, *, negative):
        if _edits(pipe):  # each prompt apart with the image(s), then padded to the longest as the branches are
            shown = _shown_images(pipe, request)
            rows = [self._masked(*pipe.encode_prompt([text], shown, device)) for text in texts]
            longest = max(row["encoder_hidden_states"].shape[1] for row in rows)
            rows = [pad_text(row, self.padded_text, longest) for row in rows]
            return {key: torch.cat([row[key] for row in rows]) for key in self.padded_text}
        return self._masked(*prompt_embeds(pipe, request, texts, device))

    @staticmethod
    def _masked(embeds, mask):
        if mask is None:  # diffusers drops a mask that masks nothing; a batch of two branches needs one
            mask = torch.ones(embeds.shape[:2], dtype=torch.bool, device=embeds.device)
        return dict(encoder_hidden_states=embeds, encoder_hidden_states_mask=mask.bool())

    def prepare(self, pipe, request, prepared, device):
        factor = pipe.vae_scale_factor * 2  # latent pixels × the 2 × 2 packing
        if _edits(pipe):
            sizes = _vae_sizes(request)  # the size drawn where the request gives none: the last image's
            prepared.latents, prepared.extra["reference"] = self.packed_latents(
                pipe, request, prepared, device, sizes[-1], images=_encoded_images(pipe, request)
            )
            references = [(1, *grid) for grid in self.appended_grids(pipe, request)]
        else:
            prepared.latents, references = self.packed_latents(pipe, request, prepared, device), []
        height, width = prepared.extra["size"]
        prepared.extra["image_shapes"] = [(1, height // factor, width // factor), *references]
        if pipe.transformer.config.guidance_embeds and request.guidance_scale is None:
            raise ValueError("this Qwen-Image model is guidance-distilled: give guidance_scale")
        mu = self.image_tokens_shift(pipe, prepared.latents.shape[1])
        self.set_timesteps(pipe, request, prepared, device, mu, flow_sigmas=False)

    def appended_grids(self, pipe, request):
        """The edit pipelines' reference images, a grid of packed tokens each, as img_shapes lists them."""
        if not _edits(pipe):
            return ()
        factor = pipe.vae_scale_factor * 2
        return tuple((height // factor, width // factor) for height, width in _vae_sizes(request))

    def packed_latents(self, pipe, request, prepared, device, default_size=None, generator=None, images=None):
        """As PackedLatentsRecipe's, the edit pipelines' size cut to multiples of the packed latent's pixels as
        they cut it, and the reference images' packed latents beside (prepare_latents encodes them first)."""
        if images is None:
            return super().packed_latents(pipe, request, prepared, device, default_size, generator)
        multiple = pipe.vae_scale_factor * 2
        height, width = request.height or default_size[0], request.width or default_size[1]
        prepared.extra["size"] = (height // multiple * multiple, width // multiple * multiple)
        return self.image_latents(pipe, request, prepared, device, *prepared.extra["size"], images, generator=generator)

    def planned_request(self, configs, call, element):
        rows, cols, latents = self.packed_grid(configs, call, element)
        text = call.options["max_sequence_length"]
        per_row = text * (configs["transformer"]["joint_attention_dim"] * element + 1)  # states and the bool mask
        why = (
            f"conditioning: at most max_sequence_length {text} text tokens a row; Qwen-Image pads a batch to its "
            f"longest prompt, whose length is known only once it is tokenized"
        )
        if "processor" in configs:  # an edit folder: Qwen2.5-VL reads the image(s) with the prompt
            why = (
                f"conditioning: {text} text tokens a row (max_sequence_length; the edit pipelines cut no prompt), "
                f"and the image's vision tokens beside them, and the reference images' latents (image inputs) and "
                f"PipeFusion's stale K/V of their tokens, known once the images are given: pipe.memory_plan_for "
                f"counts them"
            )
        return RequestShape(latents, per_row, 0, (rows, cols), None, bounds=(why,))

    def model_kwargs(self, pipe, prepared, model_input, t):
        image_shapes = [prepared.extra["image_shapes"]] * model_input.shape[0]
        return dict(super().model_kwargs(pipe, prepared, model_input, t), img_shapes=image_shapes)

    def guide(self, pipe, prepared, noise, step_index):
        """True CFG, rescaled to the conditional prediction's norm per token, as QwenImagePipeline does."""
        if "reference" in prepared.extra:  # the prediction of the drawn tokens alone
            noise = noise[:, : prepared.latents.shape[1]]
        if not prepared.do_cfg:
            return noise
        uncond, cond = noise.chunk(2)
        guided = uncond + prepared.guidance_scale * (cond - uncond)
        return guided * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(guided, dim=-1, keepdim=True))

    def decoded(self, pipe, prepared, latents):
        height, width = prepared.extra["size"]
        latents = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)
        return causal_vae_decoded(pipe, latents)[:, :, 0]  # one frame


# what image= is, as each edit pipeline takes it (its errors say)
_IMAGE_TAKEN = dict(QwenImageEditPipeline="a PIL image", QwenImageEditPlusPipeline="a PIL image, or a list of them")


def _edits(pipe) -> bool:
    return type(pipe).__name__ in EDIT_PIPELINES


def _images(request) -> list:
    image = request.options["image"]
    return image if isinstance(image, list) else [image]


def _vae_sizes(request) -> list[tuple[int, int]]:
    """(height, width) of each image as the edit pipelines encode it: its aspect at 1024² pixels."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import VAE_IMAGE_SIZE, calculate_dimensions

    return [calculate_dimensions(VAE_IMAGE_SIZE, image.size[0] / image.size[1])[::-1] for image in _images(request)]


def _shown_images(pipe, request):
    """What an edit pipeline's processor shows Qwen2.5-VL with the prompt: Edit's one image at 1024² pixels,
    Plus's each at 384² (its aspect kept)."""
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import CONDITION_IMAGE_SIZE, calculate_dimensions

    resize = pipe.image_processor.resize
    if type(pipe).__name__ == "QwenImageEditPipeline":
        (image,), (size,) = _images(request), _vae_sizes(request)
        return resize(image, *size)
    sizes = [calculate_dimensions(CONDITION_IMAGE_SIZE, image.size[0] / image.size[1]) for image in _images(request)]
    return [resize(image, height, width) for image, (width, height) in zip(_images(request), sizes)]


def _encoded_images(pipe, request):
    """What an edit pipeline's VAE encodes, [1, 3, 1, H, W] per image at its 1024² size (Edit: one tensor, as
    QwenImageEditPipeline hands it to prepare_latents; Plus: a list)."""
    processor, sizes = pipe.image_processor, _vae_sizes(request)
    if type(pipe).__name__ == "QwenImageEditPipeline":  # resized first, as the processor's image was
        (image,), (size,) = _images(request), sizes
        return processor.preprocess(processor.resize(image, *size), *size).unsqueeze(2)
    return [processor.preprocess(image, *size).unsqueeze(2) for image, size in zip(_images(request), sizes)]


RECIPE = QwenImageRecipe()


def padded_text_mask(batch: int, text_len: int) -> torch.Tensor:
    """[batch, text_len] bool: each sample's text a different length (0 to 2 padded tokens), as a batch pads it."""
    return torch.arange(text_len)[None, :] < (text_len - torch.arange(batch) % 3)[:, None]


def tiny_inputs(batch, height, width, text, timestep, randn):
    """2 × 2 latent pixels packed per token; padded text, a different length per sample."""
    grid = (1, height // 2, width // 2)
    return dict(
        hidden_states=randn(batch, grid[1] * grid[2], 16),
        encoder_hidden_states=text,
        encoder_hidden_states_mask=padded_text_mask(batch, text.shape[1]),
        timestep=timestep / 1000,
        img_shapes=[[grid]] * batch,
    )


TINY = TinySpec(  # modelled on diffusers' own test of QwenImageTransformer2DModel
    transformer=dict(
        patch_size=2, in_channels=16, out_channels=4, joint_attention_dim=TEXT_DIM, axes_dims_rope=(8, 4, 4)
    ),
    inputs=tiny_inputs,
    pipeline_classes=("QwenImagePipeline",),
    parts=dict(  # 2 × 2 patches of 4 latent channels packed into 16
        text_encoder=Part("qwen_vl_encoder", seed=1, vocab_of="tokenizer"),
        tokenizer=Part("qwen_tokenizer"),
        vae=Part("qwen_vae", seed=2, kwargs=dict(latent_channels=4)),
        scheduler=flow_scheduler(shift=1.0, max_shift=0.9, max_image_seq_len=8192, time_shift_type="exponential"),
    ),
    # an 8 × 8 latent: 4 × 4 tokens; the text as long as each prompt encodes, padded and masked in a batch
    call=dict(height=32, width=32),
)
