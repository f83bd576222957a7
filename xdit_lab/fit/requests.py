"""The request a plan is for (make_call: the folder's call defaults over the family's, the caller's over
both) and what it keeps besides the weights (request_shape): each family's recipe has the closed form
(Recipe.planned_request, in xdit_lab/families/<family>.py), from the folder's configs alone. Each is
checked against the family's own encode and prepare on tiny pipelines (tests/test_fit.py)."""

from __future__ import annotations

import inspect

from ..families import RECIPES, Recipe, Request
from ..families.recipe import Call, RequestShape
from ..model_folder import ModelFolder, ModelFolderError, read_json

__all__ = ["Call", "RequestShape", "make_call", "request_shape"]


def request_shape(folder: ModelFolder, call: Call) -> RequestShape:
    """What `call` keeps besides the weights on a rank that holds the whole batch (latents, conditioning)."""
    return RECIPES[folder.pipeline_class].planned_request(folder.configs, call, folder.element)


def make_call(
    folder: ModelFolder,
    *,
    height: int | None = None,
    width: int | None = None,
    batch: int = 1,
    use_cfg: bool | None = None,
    options: dict | None = None,
) -> Call:
    """The request a plan is for: the folder's call defaults (call_defaults.json) over the family's,
    what the caller passes over both, and the branches the family's recipe runs for it."""
    if folder.pipeline_class not in RECIPES:
        raise ModelFolderError(
            f"xdit_lab does not run {folder.pipeline_class}, so it plans no memory for it; pipelines it runs: "
            f"{', '.join(RECIPES)}"
        )
    recipe = RECIPES[folder.pipeline_class]
    if type(recipe).planned_request is Recipe.planned_request:
        raise ModelFolderError(
            f"the planner has no closed form for {folder.pipeline_class}'s latents and conditioning yet "
            f"({recipe.family}'s recipe has no planned_request); plan it on a loaded pipeline: "
            f"pipe.memory_plan_for(prompts)"
        )
    if "vae" not in folder.configs:
        raise ModelFolderError(
            f"{folder.path} has no vae component: the planner sizes the latents from the VAE's config; "
            f"copy the whole pipeline folder"
        )
    defaults_file = folder.path / "call_defaults.json"
    call_defaults = read_json(defaults_file, "call defaults") if defaults_file.is_file() else {}
    merged = {**recipe.call_defaults(folder.pipeline_class), **recipe.options, **call_defaults, **(options or {})}
    merged.update({k: v for k, v in recipe.planned_option_defaults(folder.configs).items() if merged.get(k) is None})
    if merged.get("max_sequence_length") is None:  # the pipeline's own default (PixArt-α 120, PixArt-Σ 300)
        import diffusers

        signature = inspect.signature(getattr(diffusers, folder.pipeline_class).__call__)
        merged["max_sequence_length"] = signature.parameters["max_sequence_length"].default
    default = recipe.planned_default_size(folder.configs)
    height = height or merged.get("height") or default[0]
    width = width or merged.get("width") or default[1]
    multiple = recipe.planned_multiple(folder.configs)
    bad = [f"{name} {value}" for name, value in (("height", height), ("width", width)) if value % multiple]
    if bad:
        raise ValueError(
            f"{' and '.join(bad)} not a multiple of {multiple} (the VAE's downsampling × the patch size) for "
            f"{folder.pipeline_class}; use e.g. {height // multiple * multiple or multiple}"
        )
    if use_cfg is None:
        request = Request(["?"] * batch, None, 1, merged.get("guidance_scale"), height, width, 0)
        request.options = {k: merged[k] for k in recipe.options}
        use_cfg = recipe.do_cfg(request)
    return Call(height, width, batch, 2 if use_cfg else 1, merged)
