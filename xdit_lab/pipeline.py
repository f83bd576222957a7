"""load_pipeline: a diffusers pipeline folder, planned, loaded and parallelized on this rank.

    pipe = load_pipeline("path/to/pixart", ParallelConfig(cfg=2, ulysses=2))
    images = pipe(["a red cat", "a blue dog"], seed=0).images

load_pipeline runs nine stages, in this order, each a function below of what it is given:

    1. read and check     read_and_check: the folder read once (ModelFolder: index, configs, headers, roles),
                          each file against its config, and every refusal of the LoadOptions said at once,
                          before torch.distributed is joined
    2. plan               plan_load: what this rank will hold, from the headers, against the memory it has
    3. own components     build_own_components: what this rank reads itself (a stage, a shard, quantized blocks)
    4. assemble           assemble: diffusers' from_pretrained with those in place
    5. place              place: on the device, or in host memory (on_host, and an offloaded transformer)
    6. adapt weights      adapt_weights: LoRA adapters fused into the weights
    7. parallelize        parallelize_named: the transformer(s) and the ControlNet the recipe names
    8. offload            offload_named: the transformer(s) in host memory, offload_blocks at a time on the
                          device (diffusers' group offloading, over the blocks this rank holds)
    9. the VAE            parallel_vae: each rank decodes its own images, in row bands

Between 1 and 2 the world is joined and the dtype resolved; a rank left idle by a configuration smaller than
the world stops after 2 and loads nothing.

A folder may carry its own call defaults in `call_defaults.json` beside `model_index.json`
(the bundled digits model does: its 16-pixel size, no resolution binning, its token budget,
steps, guidance and negative prompt). `pipe(...)`, `pipe.session(...)`, the Lab, the CLI and the
explorer all start from them; an argument the caller passes wins. A stock diffusers folder has
no such file and keeps the family's diffusers defaults.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import numbers
import operator
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from .accelerations import is_diffusers_cache
from .config import ParallelConfig
from .distributed import current_info, init_distributed
from .families import Request, family, recipe_for
from .load_options import LoadOptions
from .loading import (
    check_weights_match_configs,
    load_own_components,
    stage_blocks,
    stage_key_renaming,
)
from .lora import fuse_loras, lora_bytes
from .mesh import RankMesh
from .model_folder import (
    EXPERT,
    TRANSFORMER,
    ModelFolder,
    component_folders,
    read_call_defaults,
    read_model_folder,
    read_model_index,
    resolve_folder,
)
from .models import offload_blocks, parallel_state, parallelize
from .models.diffusers_cache import DiffusersCache
from .plan import MemoryPlan, check_plan, plan_memory
from .plan.loaded import plan_request
from .quantization import TRANSFORMERS
from .session import DenoiseSession
from .vae import apply_parallel_vae

ON_HOST = "xdit_lab_on_host"  # set on a module run_on_host keeps in host memory (the Lab's memory view reads it)


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


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(torch_dtype, device) -> torch.dtype:
    """The dtype load_pipeline loads in. "auto" (its default, and `xdit-lab run --dtype auto`'s) is bfloat16
    on a CUDA device, where float32 runs 5-10x slower (no tensor-core matmuls, twice the bytes moved), and
    float32 on a CPU, where the strategies are proven exact against diffusers (1e-4 relative). A torch.dtype,
    or its name ("bfloat16", "float16", "float32"), is taken as given."""
    if isinstance(torch_dtype, str):
        if torch_dtype == "auto":
            return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
        torch_dtype = DTYPES.get(torch_dtype.removeprefix("torch."), torch_dtype)
    if torch_dtype not in DTYPES.values():
        raise ValueError(
            f"torch_dtype must be 'auto' (bfloat16 on a GPU, float32 on a CPU), one of {', '.join(DTYPES)}, "
            f"or that torch dtype; got {torch_dtype!r}"
        )
    return torch_dtype


def load_pipeline(
    name_or_path,
    config: ParallelConfig | None = None,
    options: LoadOptions | None = None,
    *,
    mesh: RankMesh | None = None,
    **keywords,
) -> ParallelPipeline:
    """Load a pipeline folder of a family with a recipe (families.RECIPES) and parallelize it on this rank.

    Call on every rank. `config` defaults to one rank (serial); without torch.distributed
    initialised, the world is joined here as `init_distributed()` would (a world of one in a
    plain Python process, torchrun's world under torchrun). `options` (a LoadOptions) says how the weights
    load; each of its fields may be given as a keyword too, and a keyword wins over `options`' field:
    `load_pipeline(folder, config, shard_weights=True)` is `load_pipeline(folder, config,
    LoadOptions(shard_weights=True))`. `mesh`: a RankMesh of `config` to run on (default: one made here, closed
    with the pipeline). What the options refuse for this folder is said before any weight is read
    (LoadOptions.problems), all at once.

    `memory_limit_bytes` overrides the
    memory a rank is assumed to have (default: free GPU memory, or available RAM shared by this
    host's ranks). `cache=StepCache(threshold)` skips the blocks after the first at steps where the
    first block barely changed, decided by all ranks together (results carry `cache_skips`); one of
    diffusers' cache configurations (FirstBlockCacheConfig, TaylorSeerCacheConfig, MagCacheConfig,
    PyramidAttentionBroadcastConfig, SeaCacheConfig, FasterCacheConfig) runs diffusers' own hooks with one
    decision for every rank (models/diffusers_cache.py; `pipe.enable_cache(config)` / `pipe.disable_cache()`
    after loading).
    `compile=True` compiles the transformer whole (see `parallelize`); the first step pays for it.

    `shard_weights=True` shards the transformer's weights over the ranks that hold the same ones (the
    world under dp × cfg × ring × ulysses, a stage's ranks under PipeFusion) and every text encoder's over
    the world, with torch's FSDP2: each rank keeps 1/N of them and gathers a block just before it runs
    (models/sharded_weights.py; the gathers are recorded under "weights" in comm_log()). Each rank reads
    from the files only the rows it keeps (loading.py). On one rank there is nothing to shard: it says so.
    `on_host=("text_encoder_2",)` keeps those text encoders in host memory and runs them there (their
    outputs come to this rank's device): nothing of them on the GPU, a slower encode.
    `offload_blocks=N` keeps the transformer (and Wan 2.2 A14B's second expert) in host memory and brings its
    blocks to the device N at a time as they run, everything outside the blocks with each call (diffusers' group
    offloading, after parallelize: a PipeFusion stage offloads the blocks it holds; models/offload.py): the
    device holds the root and N blocks, and every weight crosses to it once per transformer call (per patch for
    a stage's blocks). Not with shard_weights on several ranks, nor with compile.
    `quantization="int8"` (or "float8", or diffusers' PipelineQuantizationConfig with torchao configs)
    quantizes the linear weights of the transformer and the text encoders with torchao, block by block as
    they are read (quantization.py): the plan counts the quantized bytes before loading.
    `lora=[(path_or_state_dict, scale), ...]` (Wan 2.2 A14B: `(path, scale, "transformer_2")` for the second
    expert's) loads LoRA adapters with diffusers' loaders and fuses them into the
    weights (fuse_lora=True) before the transformer is parallelized or compiled (lora.py); under PipeFusion each
    stage fuses its own blocks' share. The plan counts the adapters' bytes, held while they are fused.

    `pipeline_class="FluxImg2ImgPipeline"` runs the folder as another diffusers pipeline of its family, as
    `FluxImg2ImgPipeline.from_pretrained(folder)` does: image to image from a FluxPipeline folder,
    "WanImageToVideoPipeline" from Wan 2.2 TI2V 5B's. The pipelines each family runs: families.RECIPES.

    `torch_dtype="auto"` (the default) loads bfloat16 on a GPU and float32 on a CPU (resolve_dtype).
    `controls=Controls(...)` (xdit_lab.models) hands this pipeline's models deliberately wrong variants (tests
    and lessons show that a bound catches them); by default none."""
    options = LoadOptions.given(options, **keywords)
    config = ParallelConfig() if config is None else config
    model, recipe, call_defaults = read_and_check(name_or_path, config, options)
    if not dist.is_initialized():
        init_distributed()
    info = current_info()
    dtype = resolve_dtype(options.torch_dtype, info.device)
    model = model.in_dtype(dtype)
    owns_mesh = mesh is None  # a mesh made here is closed with the pipeline (or if loading fails)
    mesh = mesh or RankMesh(config)
    try:
        plan = plan_load(model, recipe, config, options, call_defaults, dtype, info)
        if not mesh.active:  # a rank left idle by a configuration smaller than the world loads nothing
            return ParallelPipeline(
                None, recipe, config, mesh, info.device, plan, model.path, call_defaults=call_defaults,
                owns_mesh=owns_mesh,
            )  # fmt: skip
        loaded = build_own_components(model, config, mesh, dtype, info.device, options)
        inner = assemble(model, dtype, loaded, plan)
        recipe.check_pipeline(inner)
        place(inner, loaded, options.on_host, info.device, offloaded=options.offloaded is not None)
        adapt_weights(inner, model, config, mesh, options.adapters)
        parallelize_named(inner, config, mesh, options)
        offload_named(inner, options.offloaded, info.device)
        parallel_vae(inner, config, mesh)
        return ParallelPipeline(
            inner, recipe, config, mesh, info.device, plan, model.path, progress=options.progress,
            call_defaults=call_defaults, owns_mesh=owns_mesh,
        )  # fmt: skip
    except BaseException:
        if owns_mesh:
            mesh.close()
        raise


# ---- the stages, in load_pipeline's order --------------------------------------------------------------------------
def read_and_check(name_or_path, config: ParallelConfig, options: LoadOptions) -> tuple[ModelFolder, object, dict]:
    """Stage 1, before torch.distributed is joined or a weight is read: the folder read once (its index, configs,
    headers and roles: ModelFolder), each file checked against its config, the degrees against the mesh and the
    family's branches, and every refusal of the options said at once (LoadOptions.problems). Returns the folder as
    the pipeline class it runs as, its recipe and its call defaults."""
    RankMesh.check(config)  # a configuration no mesh can be built from (cfg 3): said before anything is read
    path = resolve_folder(name_or_path)
    index = read_model_index(path)
    recipe = recipe_for(index.get("_class_name", "?"), index)
    recipe.check_branches(config.cfg)
    components = component_folders(path, index)  # a missing one named before anything reads it
    model = read_model_folder(path, index=index)  # read once: configs, headers, roles (in the load dtype later)
    options.check(recipe, model, config)
    if options.shard_weights and not options.sharding(config):
        warnings.warn(
            f"shard_weights=True on {config.world_size} rank: there is nothing to shard over, every weight stays "
            f"whole on this rank; run on more ranks (e.g. ParallelConfig(ulysses=2) on 2) to shard them",
            stacklevel=3,
        )
    pipeline_class = options.pipeline_class_of(model)
    if pipeline_class != model.pipeline_class:  # run as another pipeline of the family: its index says so
        model = dataclasses.replace(
            model, pipeline_class=pipeline_class, index={**index, "_class_name": pipeline_class}
        )
    check_weights_match_configs(model, components)  # from the headers read above
    call_defaults = {**recipe.call_defaults(pipeline_class), **read_call_defaults(path, recipe)}
    return model, recipe, call_defaults


def plan_load(model: ModelFolder, recipe, config, options: LoadOptions, call_defaults: dict, dtype, info) -> MemoryPlan:
    """Stage 2: what this rank will hold (bytes per component, from the headers, as it holds them: a stage, a
    shard, on the host, offloaded, quantized; the adapters while they are fused), checked against the memory it
    has."""
    sharding, quantized, adapters = options.sharding(config), options.quantized(model), options.adapters
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", info.world_size))
    plan = plan_memory(  # the row `xdit-lab plan --model` prints for this configuration and placement
        model, component_folders(model.path, model.index), dtype=dtype, config=config,
        ranks_per_host=min(local_ranks, config.world_size), shard_weights=sharding, on_host=options.on_host,
        quantized=quantized, offload=options.offloaded, call_defaults=call_defaults, request=True,
    )  # fmt: skip
    if adapters:  # held while they are fused into the weights, then freed
        plan.activation_bytes["LoRA adapters"] = (lora_bytes(adapters),) * 2
    check_plan(plan, info.device, limit_bytes=options.memory_limit_bytes, config=config)
    return plan


def build_own_components(model: ModelFolder, config, mesh, dtype, device, options: LoadOptions) -> dict:
    """Stage 3: the components this rank builds from the files itself, reading only what it keeps (a stage's
    blocks, a shard's rows, quantized blocks); diffusers loads the rest (loading.load_own_components)."""
    return load_own_components(
        model, config, mesh, dtype, device, sharding=options.sharding(config), quantized=options.quantized(model),
        on_host=options.on_host, offloaded=options.offloaded is not None, cache=options.cache,
        compile=options.compile, controls=options.controls,
    )  # fmt: skip


def assemble(model: ModelFolder, dtype, loaded: dict, plan: MemoryPlan):
    """Stage 4: diffusers' pipeline from the folder with this rank's own components in place; where mmap fails
    (some file systems, address-space limits) the files are read plainly instead."""
    try:
        inner = from_pretrained(model.path, model.index, dtype, loaded)
    except (OSError, RuntimeError) as error:
        if not _mentions_mmap(error):
            raise
        try:
            inner = from_pretrained(model.path, model.index, dtype, loaded, disable_mmap=True)
        except Exception as retry_error:
            raise MemoryError(
                f"loading {model.path} failed with mmap ({error}) and with plain reads ({retry_error}). "
                f"Memory plan per rank:\n{plan.table()}\nUse fewer ranks per host, bfloat16, or "
                f"PipeFusion to hold less per rank"
            ) from retry_error
    inner.set_progress_bar_config(disable=True)
    return inner


def place(inner, loaded: dict, on_host: tuple[str, ...], device, *, offloaded: bool = False) -> None:
    """Stage 5: what diffusers loaded goes to this rank's device, the text encoders named `on_host` to host memory,
    where they run (run_on_host), and with `offloaded` the transformers to host memory, which offload_named's hooks
    bring to the device a group at a time (never whole there); what this rank built itself is where it was built."""
    host = set(on_host) | ({name for name in TRANSFORMERS if name in inner.components} if offloaded else set())
    for name, component in inner.components.items():
        if isinstance(component, torch.nn.Module) and (name not in loaded or name in host):
            component.to("cpu" if name in host else device)
    for name in on_host:
        run_on_host(getattr(inner, name), device)


def adapt_weights(inner, model: ModelFolder, config, mesh, adapters: list) -> None:
    """Stage 6: the LoRA adapters fused into the weights, before the strategies' hooks and compile see the
    transformer; under PipeFusion each expert's keys renamed as its stage renames its blocks (lora.fuse_loras)."""
    if not adapters:
        return
    stage_names = None
    if config.pipefusion > 1:
        stage_names = {
            name: stage_key_renaming(model.configs[name], model.index[name][1], stage_blocks(model, config, mesh, name))
            for name in model.named(TRANSFORMER, EXPERT)
        }
    fuse_loras(inner, adapters, stage_names)


def parallelize_named(inner, config, mesh, options: LoadOptions) -> None:
    """Stage 7: the transformer, Wan 2.2 A14B's second expert (same mesh, its own cache state) and a ControlNet
    (cut like the transformer: its residuals stay on the rank) parallelized under `config`. A sharded transformer
    was parallelized before its weights were read (stage 3); under PipeFusion the ControlNet runs whole on every
    rank, each stage taking its own blocks' residuals."""
    if not options.sharding(config):
        for transformer in (inner.transformer, getattr(inner, "transformer_2", None)):
            if transformer is not None:
                parallelize(
                    transformer, config, mesh, cache=options.cache, compile=options.compile, controls=options.controls
                )
    if getattr(inner, "controlnet", None) is not None and config.pipefusion == 1:
        parallelize(inner.controlnet, config, mesh, controls=options.controls)


def offload_named(inner, blocks_at_once: int | None, device) -> None:
    """Stage 8: with `blocks_at_once` (offload_blocks), the transformer and Wan 2.2 A14B's second expert offloaded
    with diffusers' group offloading over the blocks this rank holds, after parallelize (models/offload.py)."""
    if blocks_at_once is None:
        return
    for name in TRANSFORMERS:
        transformer = getattr(inner, name, None)
        if transformer is not None:
            offload_blocks(transformer, blocks_at_once, device)


def parallel_vae(inner, config, mesh) -> None:
    """Stage 9: the VAE decodes only this rank's images, in row bands over the sequence ranks with vae_parallel."""
    if getattr(inner, "vae", None) is not None:
        apply_parallel_vae(inner.vae, mesh, bands=config.vae_parallel)


def from_pretrained(folder: Path, index: dict, dtype, loaded: dict, **kwargs):
    """diffusers' DiffusionPipeline.from_pretrained with the components built here (`loaded`) in place of
    the folder's. diffusers reads a component that its pipeline's __init__ takes as optional (Wan's
    transformer: `transformer=None`) from the folder even when it is passed in, and keeps that copy:
    those are hidden from it (a view of the folder whose index lists them as absent) and set after."""
    import tempfile

    import diffusers
    from diffusers import DiffusionPipeline

    pipeline_class = getattr(diffusers, index["_class_name"])  # the index's, or the one load_pipeline was told
    _, optional = DiffusionPipeline._get_signature_keys(pipeline_class)
    hidden = {name: module for name, module in loaded.items() if name in optional}
    passed = {name: module for name, module in loaded.items() if name not in hidden}
    if not hidden:
        return pipeline_class.from_pretrained(folder, dtype=dtype, **passed, **kwargs)
    with tempfile.TemporaryDirectory(prefix="xdit_lab_view_") as view:
        for entry in folder.iterdir():
            if entry.name != "model_index.json":
                (Path(view) / entry.name).symlink_to(entry.resolve())
        (Path(view) / "model_index.json").write_text(json.dumps({**index, **{name: [None, None] for name in hidden}}))
        inner = pipeline_class.from_pretrained(view, dtype=dtype, **passed, **kwargs)
    inner.register_modules(**hidden)
    return inner


def run_on_host(module: torch.nn.Module, device) -> None:
    """Keep `module` (a text encoder in host memory) running there: its inputs come to the host, its outputs
    go to `device`, so the pipeline's encode calls it as if it were on the device. The module is marked
    (ON_HOST), so that what reads it later knows it is in host memory even where the device is the CPU."""
    setattr(module, ON_HOST, True)

    def inputs_to_host(_module, args, kwargs):
        return _moved(args, "cpu"), _moved(kwargs, "cpu")

    def outputs_to_device(_module, _args, _kwargs, output):
        return _moved(output, device)

    module.register_forward_pre_hook(inputs_to_host, with_kwargs=True)
    module.register_forward_hook(outputs_to_device, with_kwargs=True)


def _moved(value, device):
    """Every tensor in `value` (tensors, tuples, lists, dicts and transformers' ModelOutput) on `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):  # a ModelOutput too: set in place, it keeps its class and attributes
        for key in list(value.keys()):
            value[key] = _moved(value[key], device)
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(_moved(v, device) for v in value) if not hasattr(value, "_fields") else value
    return value


def _mentions_mmap(error: BaseException | None) -> bool:
    """Loaders wrap the original error ("Unable to mmap N bytes"): look down the whole chain."""
    while error is not None:
        if "mmap" in str(error).lower():
            return True
        error = error.__cause__ or error.__context__
    return False


def is_whole(value) -> bool:
    """An int (numpy's and 0-d integer tensors too), not a bool: what sizes, steps and seeds must be."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def at_least_one(name: str, value, default):
    """`value` when it is a whole number ≥ 1, `default` for None; else a clear error (0 and negatives were
    taken for the default, or passed through, before)."""
    if value is None:
        return default
    if not is_whole(value) or operator.index(value) < 1:
        said = "the model's default" + ("" if default is None else f", {default}")
        raise ValueError(f"{name} must be a whole number ≥ 1, or None for {said}; got {value!r}")
    return operator.index(value)


def texts_of(name: str, value, count: int | None = None) -> list[str]:
    """`value` (a string, or a list or tuple of them) as a list of strings: `count` of them for negative
    prompts (a single string serves every prompt); a clear error for anything else."""
    if isinstance(value, str):
        return [value] * (count or 1)
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a string or a list of strings; got {type(value).__name__} {value!r}")
    if not value:
        raise ValueError(f"{name} is an empty list: give at least one string ({name}='a red cat')")
    wrong = [
        f"{name}[{i}] is {type(text).__name__} {text!r}" for i, text in enumerate(value) if not isinstance(text, str)
    ]
    if wrong:
        raise ValueError(f"{'; '.join(wrong)}: every {name} must be a string")
    if count is not None and len(value) != count:
        raise ValueError(
            f"{count} prompts but {len(value)} negative prompts: give one negative per prompt, a single string for "
            f"all, or None"
        )
    return list(value)


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

    def enable_cache(self, config) -> None:
        """diffusers' cache configuration `config` (FirstBlockCacheConfig, TaylorSeerCacheConfig, MagCacheConfig,
        PyramidAttentionBroadcastConfig, SeaCacheConfig, FasterCacheConfig) on this pipeline's transformers, as
        load_pipeline's cache= runs it: diffusers' hooks with one decision for every rank (models/diffusers_cache.py).
        Call it on every rank."""
        if not is_diffusers_cache(config):
            raise TypeError(
                f"pipe.enable_cache takes one of diffusers' cache configurations, not {type(config).__name__}; a "
                f"StepCache wraps the blocks as parallelize sets them up: load with cache=StepCache(threshold)"
            )
        for transformer in self._transformers():
            state = parallel_state(transformer)
            if state.cache is not None:
                raise ValueError(
                    f"this pipeline runs a cache already ({type(state.cache.settings).__name__}); "
                    f"call pipe.disable_cache() first"
                )
            state.cache = DiffusersCache(transformer, state, config)

    def disable_cache(self) -> None:
        """Remove the diffusers cache enable_cache (or load_pipeline's cache=) put on the transformers."""
        for transformer in self._transformers():
            state = parallel_state(transformer)
            if not isinstance(state.cache, DiffusersCache):
                raise ValueError("this pipeline runs no diffusers cache (a StepCache stays until the pipeline goes)")
            state.cache.remove()
            state.cache = None

    def _transformers(self) -> list:
        return [] if not self.active else self.recipe.transformers(self.diffusers_pipeline)

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
        """The Request a call with these arguments runs: the call defaults filled in, checked. Every argument
        a user can get wrong is refused here, on every rank alike, with what was wrong and what to do: sizes
        and steps that are not whole numbers ≥ 1 (None: the model's default), prompts that are not text or
        none at all, a generator with a seed, and prompts longer than the text encoder reads
        (Recipe.check_prompt_lengths)."""
        defaults = self.call_defaults
        negative_prompt = defaults.get("negative_prompt") if negative_prompt is None else negative_prompt
        prompts = texts_of("prompt", prompt)
        negatives = None if negative_prompt is None else texts_of("negative_prompt", negative_prompt, len(prompts))
        if generator is not None and seed is not None:
            raise ValueError(
                "pass generator= or seed=, not both: seed=N draws the initial noise from a CPU generator seeded "
                "with N, generator= from the one you give"
            )
        if seed is not None and not is_whole(seed):
            raise ValueError(f"seed must be a whole number (or None, for torch's global generator); got {seed!r}")
        if isinstance(generator, (list, tuple)) and len(generator) != len(prompts):
            raise ValueError(
                f"{len(generator)} generators for {len(prompts)} prompts: give one torch.Generator per prompt, "
                f"or one for all"
            )
        guidance_scale = defaults["guidance_scale"] if guidance_scale is None else guidance_scale
        if guidance_scale is not None and not (
            isinstance(guidance_scale, numbers.Real) and not isinstance(guidance_scale, bool)
        ):
            raise ValueError(f"guidance_scale must be a number (e.g. 4.5); got {guidance_scale!r}")
        request = Request(
            prompts=prompts,
            negatives=negatives,
            num_inference_steps=at_least_one(
                "num_inference_steps", num_inference_steps, defaults["num_inference_steps"]
            ),
            guidance_scale=guidance_scale,
            height=at_least_one("height", height, defaults.get("height")),
            width=at_least_one("width", width, defaults.get("width")),
            seed=seed,
            generator=generator,
            options=self.recipe.check_options(
                {**{k: v for k, v in defaults.items() if k in self.recipe.options}, **options}
            ),
        )
        self.check_size(request)
        self.recipe.check_negatives(request)  # cfg 2 with one branch: refused where the batch splits
        if self.diffusers_pipeline is not None:  # an idle rank has no tokenizer, and runs no request
            self.recipe.check_inputs(self.diffusers_pipeline, request)
            self.check_appended_rows(request)
            self.recipe.check_prompt_lengths(self.diffusers_pipeline, request)
        return request

    def session(self, prompt, *args, progress=False, timeline=False, **kwargs) -> DenoiseSession:
        """Prepare a generation and return it unstarted: step() it, or run() it. Arguments as
        `pipe(...)` takes them (negative_prompt, num_inference_steps, guidance_scale, height, width,
        generator, seed, and the family's options). `timeline=True` records each step's comm_timeline
        (session.last_step_spans; the Lab's session.timeline() draws it)."""
        if not self.active:
            raise RuntimeError(
                f"rank {self.mesh.rank} is idle under {self.config.short()}: only ranks with "
                f"pipe.active run generations"
            )
        return DenoiseSession(self, self.request(prompt, *args, **kwargs), progress=progress, timeline=timeline)

    def __call__(self, prompt, *args, output_type="pil", return_dict=True, **kwargs):
        """Generate, as the diffusers pipeline's own call does: the arguments `request` takes
        (negative_prompt, num_inference_steps, guidance_scale, height, width, generator, seed, and the
        family's options), and what to return (output_type, return_dict)."""
        session = self.session(prompt, *args, progress=self.progress, **kwargs)
        return session.run().result(output_type=output_type, return_dict=return_dict)

    def memory_plan_for(self, prompts, height=None, width=None, **arguments) -> MemoryPlan:
        """The load's plan, plus what a call with `prompts` (a count, or the prompts) at this size and
        with the other arguments `pipe(...)` takes (guidance_scale, negative_prompt, the family's
        options; the model's defaults where left out) leaves on this rank once a step ran: its
        latents, its conditioning and, under PipeFusion, the stale K/V buffers
        (plan.loaded.plan_request). A step's transient activations are not in it."""
        if not self.active:  # an idle rank holds nothing for a request
            return self.memory_plan
        prompts = [""] * prompts if isinstance(prompts, int) else prompts
        return plan_request(self, self.request(prompts, height=height, width=width, **arguments))

    def check_appended_rows(self, request: Request) -> None:
        """PipeFusion cuts every image after the drawn one into as many row bands as the drawn one (an edit's
        reference images, at the size its pipeline encodes them): each needs a token row per patch."""
        grids = self.recipe.appended_grids(self.diffusers_pipeline, request) if self.config.pipefusion > 1 else ()
        for number, (rows, _) in enumerate(grids, start=1):
            if rows < self.config.patches:
                raise ValueError(
                    f"reference image {number} gives {rows} token rows at the size the pipeline encodes it, fewer "
                    f"than the {self.config.patches} PipeFusion patches (each image's row bands); use fewer patches or a "
                    f"less wide image"
                )

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
        # a convolution over token rows (Sana's): every sequence shard whole rows of the height drawn (binned)
        shards = self.config.sp_degree if self.config.pipefusion == 1 else 1
        drawn = self.recipe.drawn_size(self.diffusers_pipeline, request)[0]
        if family(self.recipe.family).ADAPTER.row_convolution is not None and (drawn // multiple) % shards:
            raise ValueError(
                f"image height {drawn} gives {drawn // multiple} token rows, which {shards} sequence shards (ulysses "
                f"× ring) cannot hold as whole rows, and {self.recipe.family} convolves its tokens over rows (each "
                f"shard takes one row from each neighbour); use a height of a multiple of {shards * multiple} pixels, "
                f"or a smaller ulysses × ring"
            )
