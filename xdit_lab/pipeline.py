"""load_pipeline: a diffusers pipeline folder, planned, loaded and parallelized on this rank.

    pipe = load_pipeline("path/to/pixart", ParallelConfig(cfg=2, ulysses=2))
    images = pipe(["a red cat", "a blue dog"], seed=0).images

A folder may carry its own call defaults in `call_defaults.json` beside `model_index.json`
(the bundled digits model does: its 16-pixel size, no resolution binning, its token budget,
steps, guidance and negative prompt). `pipe(...)`, `pipe.session(...)`, the Lab, the CLI and the
explorer all start from them; an argument the caller passes wins. A stock diffusers folder has
no such file and keeps the family's diffusers defaults.

Before any weight is read, the memory plan (bytes per component per rank, from the
safetensors headers) is checked against the memory this rank has; a corrupt or truncated file
is named. Ranks left idle by a configuration smaller than the world load nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from .config import ParallelConfig, ParallelConfigError
from .distributed import current_info, init_distributed
from .families import FAMILIES, Request, recipe_for
from .loading import load_stage_transformer
from .memory import MemoryPlan, check_plan, plan_memory
from .mesh import PIPEFUSION, RankMesh
from .models import StepCache, compile_problems, parallelize
from .request_memory import plan_request, rows_of_one_prompt
from .session import DenoiseSession
from .vae import apply_parallel_vae

BUNDLED = {"digits": Path(__file__).parent / "assets" / "digits"}
CALL_DEFAULTS = "call_defaults.json"  # a folder's own defaults for pipe(...), beside model_index.json
CALL_ARGUMENTS = ("negative_prompt", "num_inference_steps", "guidance_scale", "height", "width")


@contextlib.contextmanager
def loading_bars_hidden():
    """diffusers' and transformers' loading bars off inside the block: printed once per rank (or
    for a model that loads in a blink) they only clutter the output. Restored afterwards."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    modules = (diffusers_logging, transformers_logging)
    were_enabled = [module.is_progress_bar_enabled() for module in modules]
    for module in modules:
        module.disable_progress_bar()
    try:
        yield
    finally:
        for module, enabled in zip(modules, were_enabled):
            if enabled:
                module.enable_progress_bar()


def resolve_folder(name_or_path) -> Path:
    folder = BUNDLED.get(str(name_or_path), Path(name_or_path)).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(
            f"no pipeline folder at {folder}: pass a local diffusers pipeline folder "
            f"(with model_index.json) or a bundled name ({', '.join(BUNDLED)})"
        )
    if not (folder / "model_index.json").is_file():
        raise FileNotFoundError(f"{folder} has no model_index.json: it is not a diffusers pipeline folder")
    return folder


def read_model_index(folder: Path) -> dict:
    try:
        return json.loads((folder / "model_index.json").read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{folder / 'model_index.json'} is not valid JSON ({error})") from None


def read_call_defaults(folder: Path, recipe) -> dict:
    """The folder's own call defaults (`call_defaults.json`), checked against what its pipeline takes;
    {} when the folder has none."""
    path = folder / CALL_DEFAULTS
    if not path.is_file():
        return {}
    try:
        defaults = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error})") from None
    allowed = (*CALL_ARGUMENTS, *recipe.options)
    unknown = sorted(set(defaults) - set(allowed)) if isinstance(defaults, dict) else None
    if unknown is None or unknown:
        raise ValueError(
            f"{path} must be a JSON object of {recipe.family} call arguments ({', '.join(allowed)}); "
            f"it has {unknown if unknown is not None else type(defaults).__name__}"
        )
    return defaults


def load_pipeline(
    name_or_path,
    config: ParallelConfig | None = None,
    *,
    mesh: RankMesh | None = None,
    torch_dtype: torch.dtype = torch.float32,
    memory_limit_bytes: int | None = None,
    progress: bool = True,
    cache: StepCache | None = None,
    compile: bool = False,
    **from_pretrained_kwargs,
) -> ParallelPipeline:
    """Load a pipeline folder of a family with a recipe (families.RECIPES) and parallelize it on this rank.

    Call on every rank. `config` defaults to one rank (serial); without torch.distributed
    initialised, the world is joined here as `init_distributed()` would (a world of one in a
    plain Python process, torchrun's world under torchrun). `memory_limit_bytes` overrides the
    memory a rank is assumed to have (default: free GPU memory, or available RAM shared by this
    host's ranks). `cache=StepCache(threshold)` skips the blocks after the first at steps where the
    first block barely changed, decided by all ranks together (results carry `cache_skips`).
    `compile=True` compiles the transformer whole (see `parallelize`); the first step pays for it."""
    config = ParallelConfig() if config is None else config
    if compile and compile_problems(config, cache):  # before any weight is read
        raise ParallelConfigError("; ".join(compile_problems(config, cache)))
    folder = resolve_folder(name_or_path)
    index = read_model_index(folder)
    recipe = recipe_for(index.get("_class_name", "?"))
    recipe.check_branches(config.cfg)
    call_defaults = {**recipe.defaults, **read_call_defaults(folder, recipe)}
    if not dist.is_initialized():
        init_distributed()
    info = current_info()
    owns_mesh = mesh is None  # a mesh made here is closed with the pipeline (or if loading fails)
    mesh = mesh or RankMesh(config)
    try:
        components = [
            name
            for name, value in index.items()
            if not name.startswith("_") and isinstance(value, list) and (folder / name).is_dir()
        ]
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size))
        plan = plan_memory(
            folder,
            components,
            dtype=torch_dtype,
            config=config,
            ranks_per_host=min(local_ranks, config.world_size),
            decode_latent=recipe.default_latent(folder, call_defaults),
            stale_kv_rows=rows_of_one_prompt(config, recipe, call_defaults),
        )
        check_plan(plan, info.device, limit_bytes=memory_limit_bytes, config=config)
        if not mesh.active:
            return ParallelPipeline(
                None, recipe, config, mesh, info.device, plan, folder, call_defaults=call_defaults, owns_mesh=owns_mesh
            )

        from diffusers import DiffusionPipeline

        if config.pipefusion > 1 and "transformer" in components:
            # a stage materialises only its own blocks (plus embeddings and output layers)
            transformer_config = json.loads((folder / "transformer" / "config.json").read_text())
            adapter = FAMILIES[index["transformer"][1]]
            blocks = config.stage_ranges(adapter.num_blocks(transformer_config))[mesh.coords[PIPEFUSION]]
            from_pretrained_kwargs["transformer"] = load_stage_transformer(
                folder / "transformer", index["transformer"][1], blocks, torch_dtype
            )
        try:
            inner = DiffusionPipeline.from_pretrained(folder, dtype=torch_dtype, **from_pretrained_kwargs)
        except (OSError, RuntimeError) as error:
            if not _mentions_mmap(error):
                raise
            # mmap can fail on some file systems or under address-space limits: read the files instead.
            try:
                inner = DiffusionPipeline.from_pretrained(
                    folder, dtype=torch_dtype, disable_mmap=True, **from_pretrained_kwargs
                )
            except Exception as retry_error:
                raise MemoryError(
                    f"loading {folder} failed with mmap ({error}) and with plain reads ({retry_error}). "
                    f"Memory plan per rank:\n{plan.table()}\nUse fewer ranks per host, bfloat16, or "
                    f"PipeFusion to hold less per rank"
                ) from retry_error
        inner.set_progress_bar_config(disable=True)
        recipe.check_pipeline(inner)
        inner.to(info.device)
        parallelize(inner.transformer, config, mesh, cache=cache, compile=compile)
        if getattr(inner, "vae", None) is not None:  # own images only; row bands over sp with vae_parallel
            apply_parallel_vae(inner.vae, mesh, bands=config.vae_parallel)
        return ParallelPipeline(
            inner,
            recipe,
            config,
            mesh,
            info.device,
            plan,
            folder,
            progress=progress,
            call_defaults=call_defaults,
            owns_mesh=owns_mesh,
        )
    except BaseException:
        if owns_mesh:
            mesh.close()
        raise


def _mentions_mmap(error: BaseException | None) -> bool:
    """Loaders wrap the original error ("Unable to mmap N bytes"): look down the whole chain."""
    while error is not None:
        if "mmap" in str(error).lower():
            return True
        error = error.__cause__ or error.__context__
    return False


class ParallelPipeline:
    """A diffusers pipeline whose transformer runs under a ParallelConfig; call it like diffusers'.

    `call_defaults`: what an argument left out of `pipe(...)` / `pipe.session(...)` becomes (the
    family's steps and guidance, overlaid with the folder's `call_defaults.json`)."""

    def __init__(
        self,
        diffusers_pipeline,
        recipe,
        config,
        mesh,
        device,
        plan,
        folder,
        *,
        progress=True,
        call_defaults: dict | None = None,
        owns_mesh: bool = False,
    ):
        self.diffusers_pipeline, self.recipe, self.config, self.mesh = diffusers_pipeline, recipe, config, mesh
        self.device, self.memory_plan, self.folder, self.progress = device, plan, folder, progress
        self.call_defaults = dict(recipe.defaults if call_defaults is None else call_defaults)
        self.owns_mesh = owns_mesh

    def close(self) -> None:
        """Destroy the process groups of the mesh load_pipeline made for this pipeline (a mesh passed
        in stays its caller's). Call it on every rank before loading a replacement; idempotent."""
        if self.owns_mesh:
            self.mesh.close()

    @property
    def active(self) -> bool:
        return self.diffusers_pipeline is not None

    def request(
        self,
        prompt,
        negative_prompt=None,
        num_inference_steps=None,
        guidance_scale=None,
        height=None,
        width=None,
        generator=None,
        seed=None,
        **options,
    ) -> Request:
        """The Request a call with these arguments runs: the call defaults filled in, checked."""
        defaults = self.call_defaults
        negative_prompt = defaults.get("negative_prompt") if negative_prompt is None else negative_prompt
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        negatives = (
            None
            if negative_prompt is None
            else ([negative_prompt] * len(prompts) if isinstance(negative_prompt, str) else list(negative_prompt))
        )
        if not prompts or not all(isinstance(p, str) for p in prompts):
            raise ValueError("prompt must be a string or a non-empty list of strings")
        if negatives is not None and len(negatives) != len(prompts):
            raise ValueError(
                f"{len(prompts)} prompts but {len(negatives)} negative prompts: give one negative per "
                f"prompt, a single string for all, or None"
            )
        if generator is not None and seed is not None:
            raise ValueError("pass either generator= or seed=, not both")
        request = Request(
            prompts=prompts,
            negatives=negatives,
            num_inference_steps=num_inference_steps or defaults["num_inference_steps"],
            guidance_scale=defaults["guidance_scale"] if guidance_scale is None else guidance_scale,
            height=height or defaults.get("height"),
            width=width or defaults.get("width"),
            seed=seed,
            generator=generator,
            options=self.recipe.check_options(
                {**{k: v for k, v in defaults.items() if k in self.recipe.options}, **options}
            ),
        )
        self.check_size(request)
        self.recipe.check_negatives(request)  # cfg 2 with one branch: refused where the batch splits
        return request

    def session(self, prompt, *args, progress=False, **kwargs) -> DenoiseSession:
        """Prepare a generation and return it unstarted: step() it, or run() it. Arguments as
        `pipe(...)` takes them (negative_prompt, num_inference_steps, guidance_scale, height, width,
        generator, seed, and the family's options)."""
        if not self.active:
            raise RuntimeError(
                f"rank {self.mesh.rank} is idle under {self.config.short()}: only ranks with "
                f"pipe.active run generations"
            )
        return DenoiseSession(self, self.request(prompt, *args, **kwargs), progress=progress)

    def __call__(
        self,
        prompt,
        negative_prompt=None,
        num_inference_steps=None,
        guidance_scale=None,
        height=None,
        width=None,
        generator=None,
        output_type="pil",
        return_dict=True,
        seed=None,
        **options,
    ):
        session = self.session(
            prompt,
            negative_prompt,
            num_inference_steps,
            guidance_scale,
            height,
            width,
            generator,
            seed,
            progress=self.progress,
            **options,
        )
        return session.run().result(output_type=output_type, return_dict=return_dict)

    def memory_plan_for(self, prompts, height=None, width=None, **arguments) -> MemoryPlan:
        """The load's plan, plus what a call with `prompts` (a count, or the prompts) at this size and
        with the other arguments `pipe(...)` takes (guidance_scale, negative_prompt, the family's
        options; the model's defaults where left out) leaves on this rank once a step ran: its
        latents, its conditioning and, under PipeFusion, the stale K/V buffers
        (request_memory.plan_request). A step's transient activations are not in it."""
        if not self.active:  # an idle rank holds nothing for a request
            return self.memory_plan
        prompts = [""] * prompts if isinstance(prompts, int) else prompts
        return plan_request(self, self.request(prompts, height=height, width=width, **arguments))

    def check_size(self, request: Request) -> None:
        """Height and width must tile into whole patches, and give every rank tokens to hold."""
        multiple, default = self.recipe.size_multiple(self.diffusers_pipeline)
        height, width = request.height or default[0], request.width or default[1]
        sp = self.config.sp_degree * self.config.patches
        bad = [f"{name} {value}" for name, value in (("height", height), ("width", width)) if value % multiple]
        tokens = (height // multiple) * (width // multiple) * self.recipe.token_frames(self.diffusers_pipeline, request)
        rows = height // multiple
        if self.config.pipefusion > 1 and not bad and rows < self.config.patches:
            raise ValueError(
                f"image height {height} gives {rows} token rows, fewer than the {self.config.patches} "
                f"PipeFusion patches (row bands); use a height of at least "
                f"{self.config.patches * multiple} or fewer patches"
            )
        if bad or tokens < sp:
            smallest = multiple
            while (smallest // multiple) ** 2 * self.recipe.token_frames(self.diffusers_pipeline, request) < sp:
                smallest += multiple
            fits = ", ".join(str(smallest + i * multiple) for i in range(4))
            why = (
                f"{' and '.join(bad)} not a multiple of {multiple} (VAE downsampling × patch size)"
                if bad
                else f"{tokens} tokens cannot be shared by {sp} sequence shards × patches"
            )
            raise ValueError(
                f"image size {height}×{width} does not fit: {why}. Sizes that fit {self.config.short()}: {fits}, ..."
            )
