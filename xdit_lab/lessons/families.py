"""Model families (tutorial 11): call arguments that run each tiny pipeline with real guidance.

family_call_kwargs(family, ...)     call arguments for a tiny pipeline, real CFG where the family has it
output_latents(output)              .frames (video) or .images of a pipeline output
adapter_source(family)              a family's ADAPTER in families/<family>.py, as written there
"""

from __future__ import annotations


def family_call_kwargs(family: str, steps: int = 3, negative_prompt=None) -> dict:
    """Call arguments for `save_tiny_pipeline(family)`'s pipeline, diffusers' and load_pipeline's alike:
    the tiny size, `steps` steps, and real classifier-free guidance with `negative_prompt`, so that
    cfg 2 has two branches to split (Flux, Qwen-Image, HunyuanVideo: true_cfg_scale; their
    guidance_scale is a guidance-distilled model's input). Flux.2 has no unconditional branch: it
    gets neither, and keeps its model's own guidance."""
    from ..families import family as family_module
    from ..families.recipe import TrueCFGRecipe
    from ..tiny import tiny_pipeline_kwargs

    recipe = family_module(family).RECIPE
    kwargs = dict(tiny_pipeline_kwargs(family), num_inference_steps=steps)
    if recipe.cfg_needs is None:  # guidance-distilled, one branch
        return kwargs
    if isinstance(recipe, TrueCFGRecipe):
        kwargs["true_cfg_scale"] = 2.0
    else:
        kwargs["guidance_scale"] = 3.0
    if negative_prompt is not None:
        kwargs["negative_prompt"] = negative_prompt
    return kwargs


def output_latents(output):
    """The latents of a pipeline output called with output_type="latent": .frames for video, else .images."""
    return output.frames if hasattr(output, "frames") else output.images


def adapter_source(family: str) -> str:
    """The source of one family's `ADAPTER = FamilyAdapter(...)` in the installed
    xdit_lab/families/<family>.py, as written there: the data a family is."""
    import inspect

    from ..families import family as family_module

    module = family_module(family)
    lines = inspect.getsource(module).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("ADAPTER = FamilyAdapter("))
    end = next(j for j in range(start, len(lines)) if lines[j] == ")")
    return "\n".join(lines[start : end + 1])
