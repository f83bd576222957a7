"""Family recipes: what each diffusers pipeline does around its transformer."""

from .base import Prepared, Recipe, Request
from .cogvideox import CogVideoXRecipe
from .flux import FluxRecipe
from .flux2 import Flux2Recipe
from .hunyuanvideo import HunyuanVideoRecipe
from .pixart import PixArtRecipe
from .qwenimage import QwenImageRecipe
from .sd3 import SD3Recipe
from .wan import WanRecipe

RECIPES = {
    name: recipe
    for recipe in (
        PixArtRecipe(),
        SD3Recipe(),
        FluxRecipe(),
        Flux2Recipe(),
        QwenImageRecipe(),
        HunyuanVideoRecipe(),
        CogVideoXRecipe(),
        WanRecipe(),
    )
    for name in recipe.pipeline_classes
}


def recipe_for(pipeline_class: str) -> Recipe:
    if pipeline_class not in RECIPES:
        raise ValueError(f"xdit_lab does not run {pipeline_class}; supported pipelines: {', '.join(RECIPES)}")
    return RECIPES[pipeline_class]


__all__ = ["Prepared", "Recipe", "Request", "RECIPES", "recipe_for"]
