"""Model families (tutorial 11): call arguments that run each tiny pipeline with real guidance.

family_call_kwargs(family, ...)     call arguments for a tiny pipeline, real CFG where the family has it
output_latents(output)              .frames (video) or .images of a pipeline output
adapter_source(family)              a family's entry in models/families.py, as written there
"""

from __future__ import annotations


def family_call_kwargs(family: str, steps: int = 3, negative_prompt=None) -> dict:
    """Call arguments for `save_tiny_pipeline(family)`'s pipeline, diffusers' and load_pipeline's alike:
    the tiny size, `steps` steps, and real classifier-free guidance with `negative_prompt`, so that
    cfg 2 has two branches to split (Flux, Qwen-Image, HunyuanVideo: true_cfg_scale; their
    guidance_scale is a guidance-distilled model's input). Flux.2 has no unconditional branch: it
    gets neither, and keeps its model's own guidance."""
    from ..pipelines import recipe_for
    from ..pipelines.base import TrueCFGRecipe
    from ..tiny import PIPELINES, tiny_pipeline_kwargs

    recipe = recipe_for(PIPELINES[family])
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
    """The source of one family's `FamilyAdapter(...)` entry in the installed models/families.py
    (family: its short name, "PixArt", "Flux", ...), dedented: the data a family is."""
    import inspect
    import textwrap

    from ..models import families

    lines = inspect.getsource(families).splitlines()
    for i, line in enumerate(lines):
        if line.strip() == "FamilyAdapter(" and lines[i + 1].strip() == f'"{family}",':
            indent = line[: len(line) - len(line.lstrip())]
            end = next(j for j in range(i + 1, len(lines)) if lines[j] == f"{indent}),")
            return textwrap.dedent("\n".join(lines[i : end + 1]))
    raise KeyError(f"no FamilyAdapter entry for {family!r} in {families.__file__}")
