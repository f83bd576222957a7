"""Flux.2 [dev]: a Mistral 3 text encoder (three layers' states stacked), packed 2×2 latent tokens
with 4-axis position ids, a guidance-distilled transformer, flow matching, a VAE with a batch norm
over the patched latent. Its single-stream blocks take [text; image] as one tensor.

diffusers' Flux2Pipeline has no negative prompt and no unconditional branch: guidance_scale is the
model's input (guidance-distilled), so cfg 2 has nothing to split and a negative prompt is refused.
Every prompt is padded to max_sequence_length and the transformer attends to the padding as
diffusers' does, so the ranks' rows stack as they are.

Reference images (image=, one or several): their latents follow the drawn ones in one sequence, each
image with its own value on the ids' first axis, and the prediction keeps the drawn tokens (as Kontext's,
recipe.PackedLatentsRecipe); sequence parallelism splits that sequence, and PipeFusion cuts every image of it into
as many row bands, patch i being band i of each (sharding.patch_layout, the grids read from the ids), the ids
following the patches.

Flux.2 [klein] (Flux2KleinPipeline) is the same transformer, smaller and without the guidance embedding,
reading a Qwen3 text encoder (Qwen3ForCausalLM: its states after layers 9, 18 and 27 stacked, the prompt in
Qwen3's chat). Its folder says which of two models it is (`is_distilled` in model_index.json, the pipeline's
own setting, so Recipe.for_folder picks the recipe from it):

    base        true CFG at a guidance_scale above 1: a branch on the empty prompt (or the negative_prompt,
                which diffusers takes as negative_prompt_embeds) beside the prompt's, [negative; positive]
                in one batch here, which cfg 2 splits
    distilled   one branch, guidance_scale ignored (as diffusers ignores it): cfg 2 and a negative prompt
                are refused, naming the folder's setting"""

from __future__ import annotations

import torch

from ..config import ParallelConfigError
from .adapter import FamilyAdapter
from .flux import FLUX_LAYOUT, FLUX_SCHEDULER, packed_inputs
from .recipe import PackedLatentsRecipe, RequestShape, generator_of, prompt_embeds
from .tiny_spec import TEXT_DIM, Part, TinySpec


def teacache_input(block, argument) -> torch.Tensor:
    """TeaCache's modulated input of Flux.2's first double-stream block: norm1(hidden_states) × (1 + scale) + shift,
    the first two of the six modulations temb_mod_img holds ([B, 6·dim], or per token), what its attention takes."""
    modulation = argument("temb_mod_img")
    if modulation.ndim == 2:
        modulation = modulation.unsqueeze(1)
    shift, scale = modulation.chunk(6, dim=-1)[:2]
    return (1 + scale) * block.norm1(argument("hidden_states")) + shift


ADAPTER = FamilyAdapter(
    "flux2",
    "Flux2Transformer2DModel",
    from_cp_plan=True,  # the text and its ids cut at the input, the image's ids with its tokens: cp_plan.py
    joined_block_lists=("single_transformer_blocks",),
    diffusers_cache_refused=dict(
        FirstBlockCacheConfig="its first block returns (text, image) and its last block one tensor of [text; image], "
        "which diffusers' hook subtracts one from the other (a TypeError when diffusers runs it serially, in a cache "
        "context opened by hand: Flux2Pipeline opens none); use xdit_lab.StepCache (First-Block Cache's rule, the "
        "joined blocks split per stream), TaylorSeerCacheConfig, MagCacheConfig or PyramidAttentionBroadcastConfig"
    ),
    # tensor parallelism: diffusers' _tp_plan, and the modulations it leaves whole (computed once a forward)
    tp_gathered=(
        "double_stream_modulation_img.linear",
        "double_stream_modulation_txt.linear",
        "single_stream_modulation.linear",
        "norm_out.linear",
    ),
    teacache=teacache_input,
    **FLUX_LAYOUT,
)


class Flux2Recipe(PackedLatentsRecipe):
    pipeline_classes = ("Flux2Pipeline", "Flux2KleinPipeline")  # klein's recipe: for_folder's
    output_class = "diffusers.pipelines.flux2.pipeline_output:Flux2PipelineOutput"
    defaults = dict(num_inference_steps=50, guidance_scale=4.0)  # the distilled guidance, an input
    options = dict(max_sequence_length=512, text_encoder_out_layers=(10, 20, 30), image=None)
    cfg_needs = None  # never two branches: see the module's docstring
    counted_with = " with the chat's system message"
    unbatched_conditioning = ("txt_ids",)  # one row of ids for every row (klein's two branches too)

    def for_folder(self, pipeline_class, settings):
        if pipeline_class == "Flux2KleinPipeline":
            return KLEIN_DISTILLED if settings.get("is_distilled") else KLEIN
        return RECIPE

    def prompt_tokens(self, pipe, request, text):
        # the whole chat the pipeline tokenizes (its system message included) counts against max_sequence_length
        from diffusers.pipelines.flux2.pipeline_flux2 import format_input

        chat = format_input(prompts=[text], system_message=pipe.system_message)
        ids = pipe.tokenizer.apply_chat_template(chat, add_generation_prompt=False, tokenize=True, return_dict=True)
        return len(ids["input_ids"][0])

    def do_cfg(self, request):
        return False

    def encode_texts(self, pipe, request, texts, device, *, negative):
        layers = tuple(request.options["text_encoder_out_layers"])
        embeds, text_ids = prompt_embeds(pipe, request, texts, device, text_encoder_out_layers=layers)
        # the transformer reads one row of ids whatever the batch (ids[0]): hand it that row, unbatched
        return dict(encoder_hidden_states=embeds, txt_ids=text_ids[0])

    def prepare(self, pipe, request, prepared, device):
        from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

        images, first_size = self._reference_images(pipe, request)
        prepared.latents, image_ids = self.packed_latents(pipe, request, prepared, device, default_size=first_size)
        prepared.conditioning["img_ids"] = image_ids[0]
        prepared.extra["image_ids"] = image_ids  # where each token goes back in the latent, for decode
        if images:  # their tokens after the drawn ones (PackedLatentsRecipe.model_input), with their own ids
            reference, reference_ids = pipe.prepare_image_latents(
                images=images,
                batch_size=len(request.prompts),
                generator=generator_of(request),
                device=device,
                dtype=pipe.vae.dtype,
            )
            prepared.extra["reference"] = reference
            prepared.conditioning["img_ids"] = torch.cat([image_ids, reference_ids], dim=1)[0]
        mu = compute_empirical_mu(image_seq_len=prepared.latents.shape[1], num_steps=request.num_inference_steps)
        self.set_timesteps(pipe, request, prepared, device, mu)

    def _reference_images(self, pipe, request):
        """Flux2Pipeline's condition images: each at most 1024² pixels, cut to multiples of the packed latent's
        pixels; and the first one's size, the drawn image's where the request gives none."""
        first_size, prepared_images = None, []
        for image, (height, width) in zip(_images(request), self._reference_sizes(pipe, request)):
            if image.size[0] * image.size[1] > 1024 * 1024:
                image = pipe.image_processor._resize_to_target_area(image, 1024 * 1024)
            prepared_images.append(
                pipe.image_processor.preprocess(image, height=height, width=width, resize_mode="crop")
            )
            first_size = first_size or (height, width)
        return prepared_images, first_size

    @staticmethod
    def _reference_sizes(pipe, request) -> list[tuple[int, int]]:
        """(height, width) the pipeline encodes each condition image at: at most 1024² pixels (its aspect ratio
        kept), cut to multiples of the packed latent's pixels."""
        sizes, multiple = [], pipe.vae_scale_factor * 2
        for image in _images(request):
            pipe.image_processor.check_image_input(image)
            width, height = image.size
            if width * height > 1024 * 1024:
                width, height = pipe.image_processor._resize_to_target_area(image, 1024 * 1024).size
            sizes.append((height // multiple * multiple, width // multiple * multiple))
        return sizes

    def appended_grids(self, pipe, request):
        """The reference images, a grid of packed tokens each after the drawn ones, in the order given."""
        multiple = pipe.vae_scale_factor * 2
        return tuple((height // multiple, width // multiple) for height, width in self._reference_sizes(pipe, request))

    def planned_request(self, configs, call, element):
        """Flux2Pipeline's text to image (no image=), as a rank keeps it between steps:

            latents        [prompts, rows × cols, in_channels]     packed 2 × 2, in the text's dtype
            per row        [max_sequence_length, joint_attention_dim]  the text encoder's out layers' states
                           stacked (3 × Mistral 3's hidden size; klein's: 3 × Qwen3's), every prompt padded to
                           max_sequence_length; a row per branch (klein's base: two at a guidance_scale above 1)
            shared         txt_ids [max_sequence_length, 4] and img_ids [rows × cols, 4], int64 coordinates
                           (t, h, w, l): the one row of each the transformer reads (encode_texts, prepare)

        The guidance is no tensor kept: a step makes its [rows] float32 from the scale (model_kwargs). The ids
        are counted as the row handed over; behind them encode and prepare_latents keep one per prompt (a view of
        [prompts, tokens, 4]: some 130 KB a prompt at 1024²), left out as the other families' ids are.

        Reference images (image=) would add, per prompt, each image's packed latents [its tokens, in_channels]
        in the VAE's dtype (counted as "image inputs" by pipe.memory_plan_for) and their int64 ids [tokens, 4]
        joined to img_ids, every image at most 1024² pixels; their tokens also lengthen the transformer's
        sequence, and a PipeFusion stage's stale K/V: pipe.memory_plan_for counts them once the images are given."""
        rows, cols, latents = self.packed_grid(configs, call, element)
        text = call.options["max_sequence_length"]
        per_row = text * configs["transformer"]["joint_attention_dim"] * element
        shared = (text + rows * cols) * 4 * torch.int64.itemsize
        channels = configs["vae"]["latent_channels"]  # unpatchified from in_channels = 2 × 2 × latent_channels
        return RequestShape(latents, per_row, shared, (rows, cols), (channels, 2 * rows, 2 * cols))

    def guidance_input(self, pipe, prepared):
        return prepared.guidance_scale  # handed over always, as Flux2Pipeline does

    def decoded(self, pipe, prepared, latents):
        return pipe.vae.decode(self.vae_input(pipe, prepared, latents).to(pipe.vae.dtype), return_dict=False)[0]

    def vae_input(self, pipe, prepared, latents):
        """What the VAE decodes of the final packed latents: each token put back in place by its ids, the batch
        norm undone, each token's 2 × 2 patch unfolded [prompts, latent_channels, 2 rows, 2 cols]."""
        latents = pipe._unpack_latents_with_ids(latents, prepared.extra["image_ids"])
        norm = pipe.vae.bn
        mean = norm.running_mean.view(1, -1, 1, 1).to(latents)
        std = torch.sqrt(norm.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps).to(latents)
        return pipe._unpatchify_latents(latents * std + mean)


class Flux2KleinRecipe(Flux2Recipe):
    """Flux2KleinPipeline's: Flux2Pipeline's but for its text (Qwen3's chat, its own out layers), no guidance
    input, and its branches, as the folder's `is_distilled` says (`distilled`; the module's docstring)."""

    pipeline_classes = ("Flux2KleinPipeline",)
    options = dict(Flux2Recipe.options, text_encoder_out_layers=(9, 18, 27))
    counted_with = " with Qwen3's chat template"

    def __init__(self, distilled: bool):
        self.distilled = distilled
        # what gives a call two branches: the base model's guidance above 1; the distilled model has none
        self.cfg_needs = None if distilled else "a guidance_scale above 1"

    def prompt_tokens(self, pipe, request, text):
        # the chat the pipeline tokenizes (its template's closing tokens included) counts against max_sequence_length
        chat = pipe.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
        return len(pipe.tokenizer(chat).input_ids)

    def do_cfg(self, request):
        return not self.distilled and request.guidance_scale > 1.0

    def check_branches(self, cfg, request=None):
        if cfg == 2 and self.distilled:
            raise ParallelConfigError(
                f"cfg 2 splits the branches [unconditional; conditional], but this {self.family} klein folder is "
                f"step-distilled (is_distilled: true in its model_index.json): Flux2KleinPipeline runs it on one "
                f"branch and ignores its guidance_scale. Use cfg 1 (dp 2 splits the prompts over 2 ranks), or FLUX.2 "
                f"klein's base model (is_distilled: false), whose true CFG cfg 2 splits"
            )
        super().check_branches(cfg, request)

    def check_negatives(self, request):
        if request.negatives is not None and self.distilled:
            raise ValueError(
                f"this {self.family} klein folder is step-distilled (is_distilled: true in its model_index.json): "
                f"one branch, no negative prompt; drop negative_prompt, or load FLUX.2 klein's base model "
                f"(is_distilled: false), whose true CFG takes one at a guidance_scale above 1"
            )

    def decode(self, pipe, prepared, latents, output_type):
        if output_type == "latent":  # Flux2KleinPipeline returns the VAE's input, where Flux2Pipeline its tokens
            return self.vae_input(pipe, prepared, latents)
        return super().decode(pipe, prepared, latents, output_type)

    def guidance_input(self, pipe, prepared):
        return None  # klein's transformer has no guidance embedding: diffusers hands it guidance=None


RECIPE = Flux2Recipe()
KLEIN, KLEIN_DISTILLED = Flux2KleinRecipe(distilled=False), Flux2KleinRecipe(distilled=True)


def _images(request) -> list:
    """The request's condition images (image=: one, several, or none)."""
    images = request.options["image"]
    return [] if images is None else images if isinstance(images, list) else [images]


def tiny_inputs(batch, height, width, text, timestep, randn):
    return dict(packed_inputs(batch, height, width, text, timestep, randn, axes=4), timestep=timestep / 1000)


TINY = TinySpec(  # modelled on diffusers' own test of Flux2Transformer2DModel
    transformer=dict(
        patch_size=1, in_channels=16, num_single_layers=2, joint_attention_dim=TEXT_DIM,
        timestep_guidance_channels=32, axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False,
    ),
    inputs=tiny_inputs,
    pipeline_classes=("Flux2Pipeline", "Flux2KleinPipeline"),
    parts=dict(  # Mistral 3's states after 3 layers stacked (3 × 32 wide); 2 × 2 × 4 latent channels packed into 16
        transformer=Part("transformer", kwargs=dict(joint_attention_dim=3 * TEXT_DIM, guidance_embeds=True)),
        text_encoder=Part("mistral3_encoder", seed=1, vocab_of="tokenizer"),
        tokenizer=Part("mistral_tokenizer"),
        vae=Part("flux2_vae", seed=2, kwargs=dict(latent_channels=4)),
        scheduler=FLUX_SCHEDULER,
    ),
    # the system message and the prompt are some 50 tokens: padded to 64 (the pipeline's default: 512)
    call=dict(height=16, width=16, max_sequence_length=64),
    # klein: Qwen3's states after 3 of its 27 layers stacked, no guidance embedding, and 3 heads (ulysses 2 splits
    # them unevenly, as it would 24 heads over 5 ranks)
    class_parts=dict(
        Flux2KleinPipeline=dict(
            transformer=Part(
                "transformer", kwargs=dict(joint_attention_dim=3 * TEXT_DIM, guidance_embeds=False, heads=3)
            ),
            text_encoder=Part("qwen3_causal_encoder", seed=1, vocab_of="tokenizer"),
            tokenizer=Part("qwen3_tokenizer"),
        ),
    ),
)  # fmt: skip
