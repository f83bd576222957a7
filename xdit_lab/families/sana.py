"""Sana: linear self-attention, Gemma 2 text by cross-attention, a convolution in every feed-forward, DC-AE.

Three pieces of a Sana block, and what each does on a rank that holds a shard of the image's tokens:

    attn1  linear attention (ReLU kernels): every query reads two sums over all tokens; each rank sums its
           own and one all-reduce (ulysses, then ring) makes them the whole image's    kind "linear"
    attn2  cross-attention to the whole text: local, nothing moves (as PixArt's)      kind "cross"
    ff     GLUMBConv: the tokens laid out [B, C, H, W], a 3 × 3 depthwise convolution: each rank holds
           whole rows and takes one row from each neighbour (a halo)                  row_convolution

So a shard must be whole token rows: the image's token rows a multiple of ulysses × ring (refused by name
otherwise). A PipeFusion stage holds whole patches (ulysses = ring = 1 within it, refused by name otherwise):
its warm-up steps are exact, and its patch steps attend with the other patches' sums and convolve with their
edge rows as the stage kept them (stale, as K/V are), models/pipefusion/stage.py.
"""

from __future__ import annotations

import torch

from .adapter import FamilyAdapter, RowConvolution
from .recipe import Recipe, RequestShape, binned_size, generator_of
from .tiny_spec import INNER, MAX_TOKENS, TEXT_DIM, Part, TinySpec

ADAPTER = FamilyAdapter(
    "sana",
    "SanaTransformer2DModel",
    shard_at="patch_embed",
    attention={r"\.attn1$": "linear", r"\.attn2$": "cross"},
    block_returns={"SanaTransformerBlock": dict(return_hidden_states_index=0, return_encoder_hidden_states_index=None)},
    row_convolution=RowConvolution(blocks=r"^transformer_blocks\.\d+$", module=r"^transformer_blocks\.\d+\.ff$"),
    step_cache_refused="diffusers' SanaTransformer2DModel has no cache hooks (no CacheMixin): no First-Block Cache "
    "to check it against",
    tp_refused="its MLP (GLUMBConv) is convolutions, not the Linear layers a tp plan splits, and attention alone "
    "would leave a rank most of the model",
)

# the aspect-ratio bins SanaPipeline renders a model's sample size at: 512, 1024, 2048 and 4096 pixels
BINS = {
    16: "pixart_alpha.pipeline_pixart_alpha:ASPECT_RATIO_512_BIN",
    32: "pixart_alpha.pipeline_pixart_alpha:ASPECT_RATIO_1024_BIN",
    64: "pixart_alpha.pipeline_pixart_sigma:ASPECT_RATIO_2048_BIN",
    128: "sana.pipeline_sana:ASPECT_RATIO_4096_BIN",
}
DEFAULT_SIZE = 1024  # SanaPipeline's default height and width, whatever the model's sample size
SIZE_MULTIPLE = 32  # SanaPipeline.check_inputs: height and width divisible by 32


def dc_scale(vae: dict) -> int:
    """AutoencoderDC's spatial compression, as SanaPipeline computes it: 2 ** (encoder stages - 1)."""
    return 2 ** (len(vae["encoder_block_out_channels"]) - 1)


class SanaRecipe(Recipe):
    pipeline_classes = ("SanaPipeline",)
    output_class = "diffusers.pipelines.sana.pipeline_output:SanaPipelineOutput"
    defaults = dict(num_inference_steps=20, guidance_scale=4.5)
    # complex_human_instruction None: the pipeline's own instruction; [] (or False): none
    options = dict(
        eta=0.0, use_resolution_binning=True, clean_caption=False, max_sequence_length=300,
        complex_human_instruction=None,
    )  # fmt: skip

    def size_multiple(self, pipe):
        # pixels per token; the pipeline's own multiple of 32 is check_inputs'
        return pipe.vae_scale_factor * pipe.transformer.config.patch_size, (DEFAULT_SIZE, DEFAULT_SIZE)

    def drawn_size(self, pipe, request):
        height, width = super().drawn_size(pipe, request)
        if request.options["use_resolution_binning"]:
            return binned_size(BINS, pipe.transformer.config.sample_size, height, width)
        return height, width

    def _instruction(self, pipe, request):
        """The complex human instruction the call encodes prompts with (diffusers' default where None)."""
        instruction = request.options["complex_human_instruction"]
        if instruction is None:
            import inspect

            instruction = inspect.signature(type(pipe).__call__).parameters["complex_human_instruction"].default
        return instruction

    # with the complex human instruction, diffusers tokenizes instruction + prompt to the instruction's tokens (alone)
    # + max_sequence_length - 2: a prompt is read whole where what it adds to the instruction's tokens, plus 2, is
    # at most max_sequence_length (one token fewer than without it, where the tokenizer merges nothing across)
    counted_with = " (<bos> included, counted after the complex human instruction as diffusers cuts it)"

    def prompt_tokens(self, pipe, request, text):
        instruction = self._instruction(pipe, request)
        if not instruction:
            return super().prompt_tokens(pipe, request, text)
        joined = "\n".join(instruction)
        return len(pipe.tokenizer(joined + text).input_ids) - len(pipe.tokenizer.encode(joined)) + 2

    def encode_texts(self, pipe, request, texts, device, *, negative):
        # diffusers encodes negative prompts without the instruction, at max_sequence_length tokens
        options = request.options
        embeds, mask, _, _ = pipe.encode_prompt(
            texts,
            False,
            device=device,
            clean_caption=options["clean_caption"],
            max_sequence_length=options["max_sequence_length"],
            complex_human_instruction=False if negative else self._instruction(pipe, request),
        )
        return dict(encoder_hidden_states=embeds, encoder_attention_mask=mask)

    def prepare(self, pipe, request, prepared, device):
        from diffusers.pipelines.sana.pipeline_sana import retrieve_timesteps

        prepared.extra["size"] = (request.height or DEFAULT_SIZE, request.width or DEFAULT_SIZE)  # what is asked
        prepared.extra["binned"] = request.options["use_resolution_binning"]
        height, width = self.drawn_size(pipe, request)
        generator = generator_of(request)
        prepared.timesteps, _ = retrieve_timesteps(pipe.scheduler, request.num_inference_steps, device)
        if hasattr(pipe.scheduler, "set_begin_index"):
            pipe.scheduler.set_begin_index(0)
        channels = pipe.transformer.config.in_channels
        # float32, as SanaPipeline keeps them; the model's input is cast to its dtype
        prepared.latents = pipe.prepare_latents(
            len(request.prompts), channels, height, width, torch.float32, device, generator, None
        )
        prepared.extra["step_kwargs"] = pipe.prepare_extra_step_kwargs(generator, request.options["eta"])

    def check_inputs(self, pipe, request):
        height, width = self.drawn_size(pipe, request)  # binned sizes are multiples of 32 already
        if height % SIZE_MULTIPLE or width % SIZE_MULTIPLE:
            raise ValueError(
                f"SanaPipeline draws heights and widths that are multiples of {SIZE_MULTIPLE} pixels, not "
                f"{height} × {width}; choose multiples of {SIZE_MULTIPLE}"
            )

    def planned_request(self, configs, call, element):
        t = configs["transformer"]
        height, width = call.height, call.width
        if call.options.get("use_resolution_binning", True) and t["sample_size"] in BINS:
            height, width = binned_size(BINS, t["sample_size"], height, width)
        scale = dc_scale(configs["vae"])
        rows, cols = height // scale, width // scale
        text = call.options["max_sequence_length"]
        per_row = text * configs["text_encoder"]["hidden_size"] * element + text * 8  # states, the int64 mask
        patch = t["patch_size"]
        latents = t["in_channels"] * rows * cols * 4  # float32
        return RequestShape(latents, per_row, 0, (rows // patch, cols // patch), None)

    def planned_default_size(self, configs):
        return DEFAULT_SIZE, DEFAULT_SIZE

    def planned_multiple(self, configs):
        return dc_scale(configs["vae"]) * configs["transformer"]["patch_size"]

    def default_latent_side(self, transformer_config):
        return None  # AutoencoderDC: no closed form of its decode (RequestShape.decode_latent None)

    def scale_model_input(self, pipe, model_input, t):
        return model_input.to(pipe.transformer.dtype)  # no scheduler scaling: the latents as they are

    def model_kwargs(self, pipe, prepared, model_input, t):
        rows, dtype = model_input.shape[0], pipe.transformer.dtype
        timestep = (t if t.dim() else t[None]).to(model_input.device).expand(rows)
        conditioning = prepared.conditioning
        return dict(
            hidden_states=model_input,
            encoder_hidden_states=conditioning["encoder_hidden_states"].to(dtype),
            encoder_attention_mask=conditioning["encoder_attention_mask"],
            timestep=timestep * pipe.transformer.config.timestep_scale,
            return_dict=False,
        )

    def guide(self, pipe, prepared, noise, step_index):
        noise = super().guide(pipe, prepared, noise.float(), step_index)
        if pipe.transformer.config.out_channels // 2 == pipe.transformer.config.in_channels:
            noise = noise.chunk(2, dim=1)[0]  # learned sigma: keep the noise half
        return noise

    def decoded(self, pipe, prepared, latents):
        latents = latents.to(pipe.vae.dtype)
        image = pipe.vae.decode(latents / pipe.vae.config.scaling_factor, return_dict=False)[0]
        if prepared.extra["binned"]:  # back to the size asked, as SanaPipeline does
            height, width = prepared.extra["size"]
            image = pipe.image_processor.resize_and_crop_tensor(image, width, height)
        return image


RECIPE = SanaRecipe()


def tiny_inputs(batch, height, width, text, timestep, randn):
    return dict(hidden_states=randn(batch, 4, height, width), encoder_hidden_states=text, timestep=timestep)


TINY = TinySpec(
    transformer=dict(
        in_channels=4, out_channels=4, num_cross_attention_heads=2, cross_attention_head_dim=16,
        cross_attention_dim=INNER, caption_channels=TEXT_DIM, sample_size=8, patch_size=1,
    ),
    inputs=tiny_inputs,
    pipeline_classes=("SanaPipeline",),
    parts=dict(  # three heads: uneven over two ranks (the linear attention's sums split no heads)
        transformer=Part("transformer", kwargs=dict(heads=3)),
        text_encoder=Part("gemma2_encoder", seed=1, vocab_of="tokenizer"),
        tokenizer=Part("gemma_tokenizer"),
        vae=Part("dc_vae", seed=2, kwargs=dict(latent_channels=4, scaling_factor=0.41407)),
        # the real folders' scheduler: DPM-Solver++ on flow matching, its sigmas shifted by 3
        scheduler=Part(
            "DPMSolverMultistepScheduler",
            kwargs=dict(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0),
        ),
    ),
    call=dict(height=32, width=32, max_sequence_length=MAX_TOKENS, use_resolution_binning=False),
)  # fmt: skip
