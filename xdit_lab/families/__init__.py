"""The diffusers DiT families xdit_lab runs, one file each: `families/<name>.py` holds the family's
adapter (`ADAPTER`, how its transformer is cut: adapter.py), its pipeline recipe (`RECIPE`, what the
pipeline does around the transformer: recipe.py; None where no pipeline is offered) and its tiny
specimen (`TINY`: tiny_spec.py). What the ControlNet pipelines share is controlnet.py; what load_pipeline
refuses to combine with a pipeline, refusals.py. The module's name is the family's one spelling, in tables, tiny keys
and errors. This package finds the family files itself: adding a family is adding a file (README: Adding a
family).

    FAMILIES        transformer class name -> FamilyAdapter
    CONTROLNETS     ControlNet class name -> FamilyAdapter (a family's CONTROLNET_ADAPTER: its transformer's layout,
                    residuals out, nothing gathered)
    RECIPES         pipeline class name -> Recipe, at the pipeline's default settings (recipe_for(name, index): as a
                    folder's model_index.json sets them)
    family(name)    a family's module, by its name ("flux")
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from .adapter import FamilyAdapter
from .cp_plan import with_plan
from .recipe import Prepared, Recipe, Request

SUPPORTED_DIFFUSERS = ("0.42", "0.43")  # tested range: >= first, < second

MODULES = {
    info.name: module
    for info in pkgutil.iter_modules(__path__)
    if hasattr(module := importlib.import_module(f"{__name__}.{info.name}"), "ADAPTER")
}
FAMILIES = {module.ADAPTER.class_name: module.ADAPTER for module in MODULES.values()}
CONTROLNETS = {
    module.CONTROLNET_ADAPTER.class_name: module.CONTROLNET_ADAPTER
    for module in MODULES.values()
    if hasattr(module, "CONTROLNET_ADAPTER")
}
RECIPES = {
    name: module.RECIPE.for_folder(name, {})
    for module in MODULES.values()
    if module.RECIPE
    for name in module.RECIPE.pipeline_classes
}


def family(name: str):
    """The family's module (its ADAPTER, RECIPE and TINY) by its name."""
    if name not in MODULES:
        raise KeyError(f"no family {name!r}; families: {', '.join(MODULES)}")
    return MODULES[name]


def adapter_for(transformer) -> FamilyAdapter:
    """The adapter of a diffusers transformer, by its class (through the class's bases: FSDP2 and
    torch.compile wrap a model in a subclass of its own)."""
    for cls in type(transformer).__mro__:
        if cls.__name__ in FAMILIES or cls.__name__ in CONTROLNETS:
            return _with_plan(cls.__name__, cls)
    raise TypeError(
        f"xdit_lab cannot parallelize {type(transformer).__name__}; supported transformers: {', '.join(FAMILIES)}; "
        f"ControlNets: {', '.join(CONTROLNETS)}"
    )


@functools.cache
def _with_plan(class_name: str, cls) -> FamilyAdapter:
    """The adapter of diffusers class `cls`, with what its `_cp_plan` declares where the adapter says
    `from_cp_plan` (families/cp_plan.py): once per class."""
    adapter = FAMILIES.get(class_name) or CONTROLNETS[class_name]
    return with_plan(adapter, cls) if adapter.from_cp_plan else adapter


def recipe_for(pipeline_class: str, index: dict | None = None) -> Recipe:
    """The recipe that runs `pipeline_class`; given a folder's model_index.json (`index`), as the pipeline's
    settings there make it (Recipe.for_folder)."""
    if pipeline_class not in RECIPES:
        raise ValueError(f"xdit_lab does not run {pipeline_class}; supported pipelines: {', '.join(RECIPES)}")
    return RECIPES[pipeline_class] if index is None else RECIPES[pipeline_class].for_folder(pipeline_class, index)


def block_index(transformer_config: dict, key: str) -> int | None:
    """The stacked block index of a tensor name in a transformer folder (None outside the blocks, or
    for a class xdit_lab does not parallelize): Flux's double-stream blocks, then its single ones."""
    adapter = FAMILIES.get(transformer_config.get("_class_name"))
    return adapter.block_index(key, transformer_config) if adapter else None


def block_metadata(block):
    """Where a block returns its image and text states: diffusers' own declaration of its blocks, else a family's
    (FamilyAdapter.block_returns, for a block diffusers' TransformerBlockRegistry does not list)."""
    from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry

    try:
        return TransformerBlockRegistry.get(type(block))
    except ValueError:
        pass
    name = type(block).__name__
    for adapter in FAMILIES.values():
        if name in adapter.block_returns:
            return TransformerBlockMetadata(**adapter.block_returns[name])
    raise TypeError(
        f"xdit_lab does not know where {name} returns its hidden states (diffusers' TransformerBlockRegistry has "
        f"no entry for it, nor does a family's adapter: FamilyAdapter.block_returns)"
    )


@functools.cache
def check_diffusers_version(version: str | None = None) -> None:
    """Raise when the installed diffusers is outside the range these adapters were tested on
    (checked once per process and version)."""
    from packaging.version import Version

    if version is None:
        import diffusers

        version = diffusers.__version__
    low, high = SUPPORTED_DIFFUSERS
    if not Version(low) <= Version(version) < Version(high):
        raise RuntimeError(
            f"diffusers {version} is installed, but xdit_lab's model adapters support diffusers >= {low}, < {high} "
            f"(module names and attention layouts change between releases). "
            f"Install a supported release: pip install 'diffusers>={low},<{high}'"
        )


__all__ = [
    "CONTROLNETS",
    "FAMILIES",
    "MODULES",
    "RECIPES",
    "SUPPORTED_DIFFUSERS",
    "FamilyAdapter",
    "Prepared",
    "Recipe",
    "Request",
    "adapter_for",
    "block_index",
    "block_metadata",
    "check_diffusers_version",
    "family",
    "recipe_for",
]
