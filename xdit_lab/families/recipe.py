"""What a family's pipeline adds around the transformer, reusing the diffusers pipeline's own
methods (encode_prompt, prepare_latents, the scheduler, the VAE): a Recipe.

The denoising loop itself lives in session.py and is the same for every family; a recipe only
answers the questions that differ: how prompts become conditioning for the batch
[unconditional; conditional], how latents and timesteps are prepared, which keyword arguments
the transformer takes, how the scheduler steps, and how latents become images.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field

import numpy as np
import torch

from ..config import ParallelConfigError
from .adapter import VIDEO


@dataclass
class Request:
    """Everything one generation depends on; identical on every rank (checked by hash)."""

    prompts: list[str]
    negatives: list[str] | None
    num_inference_steps: int
    guidance_scale: float
    height: int | None
    width: int | None
    seed: int | None  # a CPU generator seeded with this, unless `generator` is given
    generator: torch.Generator | list | None = None
    options: dict = field(default_factory=dict)  # family-specific pipeline arguments


@dataclass(frozen=True)
class Call:
    """A request as the planner sees it before anything is loaded: size, prompts, branches, options."""

    height: int
    width: int
    prompts: int
    branches: int
    options: dict


@dataclass(frozen=True)
class RequestShape:
    """What a request keeps besides the weights, in bytes, and its token layout: a recipe's closed form
    (Recipe.planned_request), from the folder's configs alone."""

    latents_per_prompt: int
    conditioning_per_row: int  # one prompt, one branch
    shared: int  # conditioning that no row has (Flux's ids, CogVideoX's rotary tables)
    grid: tuple[int, int]  # (rows, cols) of tokens PipeFusion cuts into patches (a video's frames stacked as rows)
    decode_latent: tuple[int, int, int] | None  # (channels, rows, cols) an AutoencoderKL decodes; None: no closed form
    frames: int = 1  # latent frames (video)
    bounds: tuple[str, ...] = ()  # terms that are upper bounds, and why

    @property
    def image_tokens(self) -> int:
        return self.grid[0] * self.grid[1]


def vae_scale(vae: dict) -> tuple[int, int]:
    """(spatial, temporal) downsampling of a VAE, from its config as each pipeline computes it."""
    if "temperal_downsample" in vae:  # Wan's and Qwen-Image's VAE; Wan 2.2 TI2V's also packs 2 × 2 pixels a latent
        patch = vae.get("patch_size") or 1
        return 2 ** len(vae["temperal_downsample"]) * patch, 2 ** sum(vae["temperal_downsample"])
    if "spatio_temporal_scaling" in vae and vae.get("spatial_compression_ratio") is None:  # LTX-2's, from its blocks
        scaling = vae["spatio_temporal_scaling"]
        twice = sum(scaling) if isinstance(scaling, list) else scaling * (len(vae["layers_per_block"]) - 1)
        return vae.get("patch_size", 1) * 2**twice, vae.get("patch_size_t", 1) * 2**twice
    if "spatial_compression_ratio" in vae:  # HunyuanVideo's
        return vae["spatial_compression_ratio"], vae.get("temporal_compression_ratio", 1)
    return 2 ** (len(vae["block_out_channels"]) - 1), vae.get("temporal_compression_ratio", 1)


def latent_frames(configs: dict, call: Call) -> int:
    """A video's latent frames for the call's num_frames, as the VAE compresses time."""
    return (call.options["num_frames"] - 1) // vae_scale(configs["vae"])[1] + 1


@dataclass
class Prepared:
    """Conditioning, latents and schedule of one generation, on one rank."""

    conditioning: dict  # transformer kwargs for the batch [uncond; cond] (or cond alone)
    do_cfg: bool
    guidance_scale: float
    latents: torch.Tensor | None = None
    timesteps: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)  # scheduler kwargs and family state (sizes, ids)
    step_index: int = 0  # the step being run (the session sets it before each): a ControlNet's scale per step


class Recipe:
    pipeline_classes: tuple[str, ...] = ()
    # diffusers' output dataclass of the family's pipeline ("module:Class", imported when first used), and
    # the field that holds what decode returns
    output_class = "diffusers.pipelines.pipeline_utils:ImagePipelineOutput"
    output_field = "images"
    # what each pipeline class does where it is not the recipe's plain text to image (or video); and the pipeline
    # classes PipeFusion refuses, and why (load_pipeline says it before anything is read)
    tasks: dict = {}
    pipefusion_refused: dict = {}
    pipefusion_async_refused: dict = {}  # pipeline class -> why PipeFusion's async schedule does not run with it
    # pipeline class -> why a StepCache does not run with it (beside the adapter's); none today: a ControlNet's runs
    step_cache_refused: dict = {}
    # diffusers' pipeline runs CFG's [uncond; cond] in one transformer call (its cache hooks then keep one state for
    # both, as xdit_lab's one call does), rather than one call per branch (models/diffusers_cache.py)
    cfg_in_one_call: bool = False
    pipeline_defaults: dict = {}  # pipeline class -> its call defaults where they differ from `defaults`
    # prepared.extra's entries that hold a request's images, encoded, kept beside the latents over the steps: an
    # edit's reference tokens, inpainting's image latents, mask and first noise, Fill's masked image, an image to
    # video's first frame (the memory plan counts them, plan.loaded.plan_request)
    image_inputs = ("reference", "inpaint", "fill", "first_frame")
    # prepared.extra's entries that are latents stepped beside prepared.latents (LTX-2's audio): counted with them
    latents_beside: tuple = ()
    defaults = dict(num_inference_steps=20, guidance_scale=4.5)
    options: dict = {}  # supported pipeline-specific arguments and their defaults

    @property
    def family(self) -> str:
        """The family's one spelling: the name of the module that declares the recipe (families/<name>.py)."""
        return type(self).__module__.rsplit(".", 1)[-1]

    def task(self, pipeline_class: str) -> str:
        """What `pipeline_class` draws from what: "text to image", "image to video", ..."""
        return self.tasks.get(pipeline_class, "text to video" if self.output_field == "frames" else "text to image")

    def folder_defaults(self, folder) -> dict:
        """Call defaults a folder's own component configs set, where the pipeline reads them there rather than from
        its call's arguments (HunyuanVideo-1.5's guider scale): none by default. A call_defaults.json wins."""
        return {}

    def call_defaults(self, pipeline_class: str) -> dict:
        """The call's defaults as `pipeline_class` itself sets them in its __call__ (FluxImg2ImgPipeline's guidance
        is 7.0 where FluxPipeline's is 3.5): `defaults`, and the class's own in `pipeline_defaults`. Written here,
        not read from the signature, so that planning a folder imports no pipeline module (tests/test_families.py
        checks them against diffusers' signatures)."""
        return {**self.defaults, **self.pipeline_defaults.get(pipeline_class, {})}

    def for_folder(self, pipeline_class: str, settings: dict) -> Recipe:
        """The recipe that runs `pipeline_class` (one of pipeline_classes) as a folder's pipeline settings make it
        (`settings`: its model_index.json, where a diffusers pipeline keeps its own configuration beside the
        components: Flux.2 klein's is_distilled says one branch or two). This one, for most."""
        return self

    def check_options(self, options: dict) -> dict:
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            raise TypeError(
                f"{self.family} pipelines here do not take {', '.join(unknown)}; "
                f"supported extra arguments: {', '.join(sorted(self.options)) or 'none'}"
            )
        return {**self.options, **options}

    def check_pipeline(self, pipe) -> None:
        """Refuse, by name, a loaded pipeline this recipe cannot run as it is (before parallelizing)."""

    def size_multiple(self, pipe) -> tuple[int, tuple[int, int]]:
        """(what height and width must be multiples of, the default (height, width)) in pixels."""
        config = pipe.transformer.config
        default = config.sample_size * pipe.vae_scale_factor
        return pipe.vae_scale_factor * config.patch_size, (default, default)

    def drawn_size(self, pipe, request: Request) -> tuple[int, int]:
        """(height, width) in pixels the transformer draws for `request`: the request's, the default where it gives
        none (a family that bins sizes to its trained aspect ratios draws the bin: Sana)."""
        default = self.size_multiple(pipe)[1]
        return request.height or default[0], request.width or default[1]

    # ---- the planner's closed forms, from the folder's configs alone (xdit_lab.plan; checked against
    # what encode and prepare hold on tiny pipelines, tests/test_fit.py) ------------------------------------
    def planned_request(self, configs: dict[str, dict], call: Call, element: int) -> RequestShape:
        """What a request keeps besides the weights (`configs`: every component's config.json, and the
        tokenizers'), with floats of `element` bytes."""
        raise NotImplementedError(f"no closed form for {self.family}'s latents and conditioning")

    def planned_default_size(self, configs: dict[str, dict]) -> tuple[int, int]:
        """(height, width) the pipeline renders by default: the transformer's sample size, in pixels."""
        side = self.default_latent_side(configs["transformer"])
        return side * vae_scale(configs["vae"])[0], side * vae_scale(configs["vae"])[0]

    def planned_multiple(self, configs: dict[str, dict]) -> int:
        """What height and width must be multiples of: the VAE's downsampling × the patch size."""
        patch = configs["transformer"].get("patch_size") or 1
        return vae_scale(configs["vae"])[0] * (patch[-1] if isinstance(patch, (list, tuple)) else patch)

    def planned_option_defaults(self, configs: dict[str, dict]) -> dict:
        """Option defaults this recipe leaves to the model (None in `options`), from the configs."""
        return {}

    def default_latent_side(self, transformer_config: dict) -> int | None:
        """The latent's rows (= cols) at the pipeline's default size, from the transformer's config
        alone (before loading): what the memory plan sizes the VAE decode at."""
        return transformer_config.get("sample_size")

    def token_frames(self, pipe, request: Request) -> int:
        """Token planes per sample (frames, for video)."""
        return 1

    unbatched_conditioning: tuple[str, ...] = ()  # conditioning the same for every row (Flux: txt_ids)
    # conditioning [rows, text, ...] whose text a batch pads to its longest, masked (Qwen-Image's embeds and mask)
    padded_text: tuple[str, ...] = ()

    # what gives a call the two branches [unconditional; conditional] that cfg 2 splits; None: the
    # family never has them (and takes no negative prompt)
    cfg_needs: str | None = "a guidance_scale above 1"

    def do_cfg(self, request: Request) -> bool:
        """Whether the batch is [unconditional; conditional] (two branches) or conditional alone."""
        return request.guidance_scale > 1.0

    def check_branches(self, cfg: int, request: Request | None = None) -> None:
        """Refuse, by name, cfg 2 where there is one branch to split: at load (request None) for a
        family that never has two, and for a request that has one."""
        if cfg == 2 and self.cfg_needs is None:
            raise ParallelConfigError(
                f"cfg 2 splits the branches [unconditional; conditional], but {self.family}'s pipeline has "
                f"one branch (its guidance_scale is the model's input): use cfg 1, and dp 2 to split prompts"
            )
        if request is not None and cfg == 2 and not self.do_cfg(request):
            raise ValueError(
                f"cfg 2 splits the branches [unconditional; conditional], but this {self.family} call has "
                f"one: give it {self.cfg_needs}, or load with cfg 1"
            )

    def check_negatives(self, request: Request) -> None:
        if request.negatives is not None and self.cfg_needs is None:
            raise ValueError(
                f"{self.family}'s pipeline takes no negative_prompt: it has no unconditional branch "
                f"(its guidance_scale is the model's input); drop negative_prompt"
            )

    def check_inputs(self, pipe, request: Request) -> None:
        """Refuse, by name, what this loaded pipeline cannot take of the request (an image for a pipeline
        that takes none, a missing one), before anything runs."""

    # ---- prompts longer than the text encoder reads ---------------------------------------------------------
    # The pipeline's tokenizer whose tokens `max_sequence_length` bounds (None: no such bound). diffusers cuts a
    # longer prompt to that many tokens and draws the rest of the image without the cut words, with at most a
    # logged warning (Wan, Qwen-Image, Flux.2 and HunyuanVideo's Llama none at all); the warning goes to each
    # rank's log, which a notebook's engines never show. So a request is checked here instead, and refused.
    bounded_tokenizer: str | None = "tokenizer"
    longest_text: int | None = None  # the most max_sequence_length the pipeline takes (None: no cap it checks)
    counted_with = ""  # what else prompt_tokens counts, said in the error (a template's closing tokens)

    def token_budget(self, pipe, request: Request) -> int | None:
        """max_sequence_length as the call runs it: the request's, else the pipeline's own default (PixArt-α's
        encode_prompt: 120, PixArt-Σ's: 300)."""
        limit = request.options.get("max_sequence_length")
        if limit is None and hasattr(pipe, "encode_prompt"):
            parameter = inspect.signature(pipe.encode_prompt).parameters.get("max_sequence_length")
            if parameter is not None and parameter.default is not inspect.Parameter.empty:
                limit = parameter.default
        return limit

    def prompt_tokens(self, pipe, request: Request, text: str) -> int | None:
        """How many tokens `text` is where the pipeline's encode_prompt cuts it to max_sequence_length: the
        bounded tokenizer's ids, special tokens included, as the pipeline tokenizes before it truncates
        (families with a template count what follows the part they crop). None: nothing to count."""
        tokenizer = getattr(pipe, self.bounded_tokenizer, None) if self.bounded_tokenizer else None
        return None if tokenizer is None else len(tokenizer(text).input_ids)

    def text_cap(self, pipe) -> int | None:
        """The most max_sequence_length this pipeline takes (None: no cap known)."""
        return self.longest_text

    def check_prompt_lengths(self, pipe, request: Request) -> None:
        """Refuse, naming each one with its tokens and the limit, prompts and negative prompts the pipeline
        would cut short."""
        limit = self.token_budget(pipe, request)
        if limit is None:
            return
        texts = [(f"prompt {i}", text) for i, text in enumerate(request.prompts)]
        texts += [(f"negative_prompt {i}", text) for i, text in enumerate(request.negatives or [])]
        over = [(name, tokens) for name, text in texts if (tokens := self.prompt_tokens(pipe, request, text)) > limit]
        if not over:
            return
        longest = max(tokens for _, tokens in over)
        cap = self.text_cap(pipe)
        raise_it = (
            f", or pass max_sequence_length={longest}"
            + ("" if cap is None else f" (the pipeline takes up to {cap})")
            + " if the model reads that many"
            if cap is None or longest <= cap
            else f" (the pipeline takes at most max_sequence_length={cap})"
        )
        listed = ", ".join(f"{name} is {tokens} tokens{self.counted_with}" for name, tokens in over)
        encoder = type(getattr(pipe, self.bounded_tokenizer)).__name__ if self.bounded_tokenizer else "its text encoder"
        raise ValueError(
            f"{listed} ({encoder}), more than this call's max_sequence_length of {limit}: diffusers' "
            f"{self.family} pipeline would cut {'them' if len(over) > 1 else 'it'} to {limit} tokens and draw "
            f"without the rest (a logged warning at most). Shorten it to {limit} tokens{raise_it}"
        )

    def encode_texts(self, pipe, request: Request, texts: list[str], device, *, negative: bool) -> dict:
        """The transformer's conditioning for `texts`, one row each, as the family's pipeline encodes
        its prompts (negative=False) or its negative prompts (negative=True)."""
        raise NotImplementedError

    def encode(self, pipe, request: Request, device, branch: int | None = None) -> Prepared:
        """Conditioning for the batch [unconditional; conditional] (or the conditional alone without
        CFG). branch 0 or 1: that branch's rows only, for a cfg rank that computes one branch."""
        do_cfg = self.do_cfg(request)
        branches = (branch,) if do_cfg and branch is not None else (0, 1) if do_cfg else (1,)
        parts = [
            self.encode_texts(
                pipe, request, request.prompts if b else negatives_or_empty(request), device, negative=not b
            )
            for b in branches
        ]
        if self.padded_text:  # each branch is encoded padded to its own longest text
            length = max(part[self.padded_text[0]].shape[1] for part in parts)
            parts = [pad_text(part, self.padded_text, length) for part in parts]
        conditioning = {
            key: value if key in self.unbatched_conditioning else torch.cat([part[key] for part in parts])
            for key, value in parts[0].items()
        }
        return Prepared(conditioning=conditioning, do_cfg=do_cfg, guidance_scale=request.guidance_scale)

    def prepare(self, pipe, request: Request, prepared: Prepared, device) -> None:
        raise NotImplementedError

    def latent_channels(self, pipe) -> int:
        """The channels of the latents the pipeline's prepare_latents draws (the transformer's input's)."""
        return pipe.transformer.config.in_channels

    def image_latents(self, pipe, request: Request, prepared: Prepared, device, height, width, *inputs, generator=None):
        """What a 2D pipeline's prepare_latents returns for the request's prompts at `height` × `width`: after
        `inputs` (an edit's reference image), latent_channels of them in the text's dtype, drawn from `generator`
        (the request's where None), none given to start from."""
        return pipe.prepare_latents(
            *inputs,
            len(request.prompts),
            self.latent_channels(pipe),
            height,
            width,
            prepared.conditioning["encoder_hidden_states"].dtype,
            device,
            generator or generator_of(request),
            None,
        )

    def model_kwargs(self, pipe, prepared: Prepared, model_input: torch.Tensor, t: torch.Tensor) -> dict:
        """The transformer's keyword arguments: SD3's and CogVideoX's as they are (others override)."""
        return dict(
            hidden_states=model_input,
            timestep=t.expand(model_input.shape[0]),
            return_dict=False,
            **prepared.conditioning,
        )

    def scale_model_input(self, pipe, model_input, t):
        return pipe.scheduler.scale_model_input(model_input, t)

    def transformers(self, pipe) -> list:
        """The pipeline's transformers, each parallelized on the same mesh: one (Wan 2.2 A14B's two experts)."""
        return [pipe.transformer]

    def transformer_for(self, pipe, prepared: Prepared, t):
        """The transformer that runs the step at timestep `t`."""
        return pipe.transformer

    def appended_tokens(self, prepared: Prepared) -> int:
        """Tokens the transformer sees after the drawn image's (Kontext's reference image): none."""
        return 0

    def appended_grids(self, pipe, request: Request) -> tuple[tuple[int, int], ...]:
        """(rows, cols) of the token grids of the images the transformer sees after the drawn one, each a grid of
        rows that PipeFusion cuts into bands with it (an edit's reference images): none."""
        return ()

    def model_input(self, pipe, prepared: Prepared, latents: torch.Tensor, t) -> torch.Tensor:
        """The transformer's input for the current latents: one copy per branch, scaled for the step."""
        return self.scale_model_input(pipe, torch.cat([latents, latents]) if prepared.do_cfg else latents, t)

    def prediction(self, pipe, prepared: Prepared, output) -> torch.Tensor:
        """The noise prediction in the transformer's output (return_dict=False): its first tensor."""
        return output[0]

    def guide(self, pipe, prepared: Prepared, noise: torch.Tensor, step_index: int) -> torch.Tensor:
        if prepared.do_cfg:
            uncond, cond = noise.chunk(2)
            noise = uncond + self.guidance_at(pipe, prepared, step_index) * (cond - uncond)
        return noise

    def guidance_at(self, pipe, prepared: Prepared, step_index: int) -> float:
        """The guidance scale of step `step_index`: the request's."""
        return prepared.guidance_scale

    def scheduler_step(self, pipe, prepared: Prepared, noise, t, latents, step_index: int) -> torch.Tensor:
        return pipe.scheduler.step(noise, t, latents, **prepared.extra.get("step_kwargs", {}), return_dict=False)[0]

    def decode(self, pipe, prepared: Prepared, latents: torch.Tensor, output_type: str):
        """What the pipeline returns for the final latents: the latents as they are (output_type "latent"),
        else the VAE's output (`decoded`) post-processed as the family's pipeline does, images or a
        video's frames (output_field)."""
        if output_type == "latent":
            return latents
        decoded = self.decoded(pipe, prepared, latents)
        if self.output_field == "frames":
            return pipe.video_processor.postprocess_video(decoded, output_type=output_type)
        return pipe.image_processor.postprocess(decoded, output_type=output_type)

    def decoded(self, pipe, prepared: Prepared, latents: torch.Tensor) -> torch.Tensor:
        """The VAE's output for the final latents, before the pipeline's post-processing."""
        raise NotImplementedError

    def wrap_output(self, images):
        module, name = self.output_class.split(":")
        return getattr(importlib.import_module(module), name)(**{self.output_field: images})

    def output_tuple(self, images) -> tuple:
        """What the pipeline returns with return_dict=False: a one-tuple of its output, as diffusers' do."""
        return (images,)


class TrueCFGRecipe(Recipe):
    """A family whose pipeline runs true CFG as a second forward, when true_cfg_scale > 1 and negative
    prompts are given (Flux, Qwen-Image, HunyuanVideo), and whose guidance_scale is an input of
    guidance-distilled models (kept in prepared.extra["distilled_guidance"]). Here the two branches
    go in one batch [negative; positive], which cfg 2 then splits."""

    cfg_needs = "a negative_prompt and a true_cfg_scale above 1"

    def do_cfg(self, request: Request) -> bool:
        return request.options["true_cfg_scale"] > 1 and request.negatives is not None

    def encode(self, pipe, request: Request, device, branch: int | None = None) -> Prepared:
        prepared = super().encode(pipe, request, device, branch)
        prepared.guidance_scale = request.options["true_cfg_scale"]
        prepared.extra["distilled_guidance"] = request.guidance_scale
        return prepared


class PackedLatentsRecipe(Recipe):
    """A family whose latents are packed 2×2 patches per token (Flux, Flux.2, Qwen-Image): sizes in
    multiples of twice the VAE's factor, the pipeline's default_sample_size and prepare_latents,
    flow-matching sigmas shifted by the image's tokens, and the transformer's call."""

    def size_multiple(self, pipe):
        default = pipe.default_sample_size * pipe.vae_scale_factor
        return pipe.vae_scale_factor * 2, (default, default)

    def default_latent_side(self, transformer_config):
        return 128  # these pipelines' default_sample_size (not in the transformer's config)

    def latent_channels(self, pipe):
        return pipe.transformer.config.in_channels // 4  # a token's 2 × 2 latent pixels are its channels

    def packed_latents(self, pipe, request: Request, prepared: Prepared, device, default_size=None, generator=None):
        """What the pipeline's prepare_latents returns (the packed latents, and ids where the family
        has them) at the request's size (where it gives none: `default_size`, else the pipeline's), in the
        text's dtype, drawn from `generator` (the request's where None); the size goes in prepared.extra["size"]."""
        default_height, default_width = default_size or self.size_multiple(pipe)[1]
        height, width = request.height or default_height, request.width or default_width
        prepared.extra["size"] = (height, width)
        return self.image_latents(pipe, request, prepared, device, height, width, generator=generator)

    def set_timesteps(self, pipe, request: Request, prepared: Prepared, device, mu: float, *, flow_sigmas=True):
        """Sigmas 1 → 1/steps, shifted by `mu`, as these pipelines set them; with `flow_sigmas` (Flux's
        and Flux.2's), none where the scheduler makes its own (use_flow_sigmas)."""
        from diffusers.pipelines.flux.pipeline_flux import retrieve_timesteps

        steps = request.num_inference_steps
        sigmas = np.linspace(1.0, 1 / steps, steps)
        if flow_sigmas and getattr(pipe.scheduler.config, "use_flow_sigmas", False):
            sigmas = None
        prepared.timesteps, _ = retrieve_timesteps(pipe.scheduler, steps, device, sigmas=sigmas, mu=mu)
        pipe.scheduler.set_begin_index(0)

    def packed_grid(self, configs: dict, call: Call, element: int) -> tuple[int, int, int]:
        """Packed latents, 2 × 2 latent pixels a token: (rows, cols, bytes per prompt)."""
        scale = vae_scale(configs["vae"])[0]
        rows, cols = call.height // (scale * 2), call.width // (scale * 2)
        return rows, cols, rows * cols * configs["transformer"]["in_channels"] * element

    def planned_multiple(self, configs):
        return vae_scale(configs["vae"])[0] * 2

    def image_tokens_shift(self, pipe, tokens: int) -> float:
        """Flux's and Qwen-Image's mu: linear in the image's tokens, from the scheduler's config."""
        from diffusers.pipelines.flux.pipeline_flux import calculate_shift

        config = pipe.scheduler.config
        return calculate_shift(
            tokens,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )

    def scale_model_input(self, pipe, model_input, t):
        return model_input.to(pipe.transformer.dtype)

    # ---- reference images (Flux.1 Kontext, Flux.2): their tokens after the drawn ones, in prepared.extra -------
    def appended_tokens(self, prepared):
        return prepared.extra["reference"].shape[1] if "reference" in prepared.extra else 0

    def model_input(self, pipe, prepared, latents, t):
        if "reference" in prepared.extra:  # the reference images' tokens after the drawn ones
            latents = torch.cat([latents, prepared.extra["reference"]], dim=1)
        return super().model_input(pipe, prepared, latents, t)

    def guide(self, pipe, prepared, noise, step_index):
        if "reference" in prepared.extra:  # the prediction of the drawn tokens alone
            noise = noise[:, : prepared.latents.shape[1]]
        return super().guide(pipe, prepared, noise, step_index)

    def guidance_input(self, pipe, prepared: Prepared) -> float | None:
        """The guidance a guidance-distilled transformer takes as an input (None: it takes none)."""
        return prepared.extra["distilled_guidance"] if pipe.transformer.config.guidance_embeds else None

    def model_kwargs(self, pipe, prepared, model_input, t):
        rows, scale = model_input.shape[0], self.guidance_input(pipe, prepared)
        guidance = None if scale is None else torch.full([rows], scale, device=model_input.device, dtype=torch.float32)
        return dict(
            hidden_states=model_input,
            timestep=t.expand(rows).to(model_input.dtype) / 1000,
            guidance=guidance,
            return_dict=False,
            **prepared.conditioning,
        )


class VideoRecipe(Recipe):
    """A video family whose pipeline keeps its latents [B, C, F, H, W] in float32 (Wan, HunyuanVideo):
    its default size in pixels, latent frames from num_frames, (t, h, w) patches a token (adapter.VIDEO),
    the latents fed to the model as they are in its dtype (flow matching), a video's frames out."""

    output_field = "frames"
    default_size = (480, 832)  # the pipeline's default (height, width) in pixels

    def size_multiple(self, pipe):
        return pipe.vae_scale_factor_spatial * VIDEO.video_patch(pipe.transformer.config)[1], self.default_size

    def default_latent_side(self, transformer_config):
        return None  # a video: the 2D decode plan does not apply

    def token_frames(self, pipe, request):
        frames = (request.options["num_frames"] - 1) // pipe.vae_scale_factor_temporal + 1
        return frames // VIDEO.video_patch(pipe.transformer.config)[0]

    def size(self, request: Request) -> tuple[int, int]:
        """The request's (height, width), the pipeline's default where it gives none."""
        return request.height or self.default_size[0], request.width or self.default_size[1]

    def video_latents(self, pipe, request: Request, device, *inputs, channels=None, after=()):
        """What the pipeline's prepare_latents returns for the request's prompts, size and num_frames: after
        `inputs` (an image to video's image), `channels` of them (the transformer's in_channels where None),
        float32 as these pipelines keep them (the model's input is cast to its dtype), drawn from the request's
        generator, then the pipeline's own arguments `after`."""
        height, width = self.size(request)
        return pipe.prepare_latents(
            *inputs,
            len(request.prompts),
            channels or pipe.transformer.config.in_channels,
            height,
            width,
            request.options["num_frames"],
            torch.float32,
            device,
            generator_of(request),
            *after,
        )

    def scale_model_input(self, pipe, model_input, t):
        return model_input.to(pipe.transformer.dtype)  # flow matching feeds latents as they are

    def planned_request(self, configs, call, element):
        t = configs["transformer"]
        scale = vae_scale(configs["vae"])[0]
        frames = latent_frames(configs, call)
        rows, cols = call.height // scale, call.width // scale
        # float32, as these pipelines keep them; the noise's channels only (an image to video's transformer takes
        # more: the image's, concatenated, counted under "image inputs")
        latents = (t.get("out_channels") or t["in_channels"]) * frames * rows * cols * 4
        pt, ph, pw = VIDEO.video_patch(t)
        grid = (frames // pt * (rows // ph), cols // pw)
        return RequestShape(latents, self.planned_text_bytes(t, call, element), 0, grid, None, frames)

    def planned_text_bytes(self, transformer: dict, call: Call, element: int) -> int:
        """The conditioning of one prompt and branch, in bytes (RequestShape.conditioning_per_row)."""
        raise NotImplementedError

    def planned_default_size(self, configs):
        return self.default_size


def binned_size(bins: dict[int, str], sample_size: int, height: int, width: int) -> tuple[int, int]:
    """The size a pipeline with resolution binning really renders: the nearest aspect-ratio bin of the table
    `bins[sample_size]` names ("module:TABLE" in diffusers.pipelines; PixArt's and Sana's pipelines each map
    their model's sample size to one)."""
    from importlib import import_module

    from diffusers.image_processor import PixArtImageProcessor

    if sample_size not in bins:
        sizes = ", ".join(map(str, bins))
        raise ValueError(
            f"resolution binning needs a sample size of {sizes}, not {sample_size}; pass use_resolution_binning=False"
        )
    module, table = bins[sample_size].split(":")
    ratios = getattr(import_module(f"diffusers.pipelines.{module}"), table)
    return PixArtImageProcessor.classify_height_width_bin(height, width, ratios=ratios)


def causal_vae_decoded(pipe, latents: torch.Tensor) -> torch.Tensor:
    """Wan's causal 3D VAE (Wan's and Qwen-Image's pipelines): the latents un-normalized by the VAE's
    per-channel means and stds, in its dtype, then decoded [B, C, F, H, W]."""
    config = pipe.vae.config
    latents = latents.to(pipe.vae.dtype)
    mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1).to(latents)
    std = torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1).to(latents)
    return pipe.vae.decode(latents * std + mean, return_dict=False)[0]


def shifted_vae_decoded(pipe, latents: torch.Tensor) -> torch.Tensor:
    """SD3's and Flux's AutoencoderKL: the latents scaled and shifted back, then decoded."""
    latents = latents / pipe.vae.config.scaling_factor + pipe.vae.config.shift_factor
    return pipe.vae.decode(latents, return_dict=False)[0]


def prompt_embeds(pipe, request: Request, texts: list[str], device, **arguments):
    """What the pipeline's encode_prompt returns for `texts`, one row each, at the request's
    max_sequence_length (SD3, Flux, Flux.2, Qwen-Image; `arguments`: the family's own)."""
    return pipe.encode_prompt(
        prompt=texts,
        device=device,
        num_images_per_prompt=1,
        max_sequence_length=request.options["max_sequence_length"],
        **arguments,
    )


def video_prompt_embeds(pipe, request: Request, texts: list[str], device) -> torch.Tensor:
    """One row of T5 embeddings per text, as CogVideoX's and Wan's pipelines encode (same signature)."""
    embeds, _ = pipe.encode_prompt(
        texts,
        None,
        do_classifier_free_guidance=False,
        num_videos_per_prompt=1,
        max_sequence_length=request.options["max_sequence_length"],
        device=device,
    )
    return embeds


def pad_text(conditioning: dict, keys: tuple[str, ...], length: int) -> dict:
    """`conditioning` with each of `keys` ([rows, text, ...]) padded to `length` text tokens with zeros
    (False in a mask): padding the masked attention never attends to."""
    padded = dict(conditioning)
    for key in keys:
        value = conditioning[key]
        if value.shape[1] < length:
            pad = value.new_zeros((value.shape[0], length - value.shape[1], *value.shape[2:]))
            padded[key] = torch.cat([value, pad], dim=1)
    return padded


def negatives_or_empty(request: Request) -> list[str]:
    return request.negatives if request.negatives is not None else [""] * len(request.prompts)


def generator_of(request: Request):
    if request.generator is not None:
        return request.generator
    if request.seed is not None:
        return torch.Generator("cpu").manual_seed(request.seed)
    return None
