"""What load_pipeline refuses to combine with a pipeline, and why: one table, which load_pipeline raises from
and the planner (plan/rows.py) reads to leave out the rows load_pipeline would refuse."""

from __future__ import annotations

from .recipe import Recipe

# load_pipeline's arguments, as its errors name them
REFUSABLE = dict(
    pipefusion="PipeFusion", pipefusion_async="pipefusion_schedule='async'", shard_weights="shard_weights",
    quantization="quantization", compile="compile", cache="a StepCache",
)  # fmt: skip
TWO_EXPERTS_REFUSED = (
    "this pipeline has two transformers (Wan 2.2 A14B's experts, transformer and transformer_2), which run under "
    "every strategy, each parallelized on the same ranks (their weights sharded or quantized too; under PipeFusion "
    "each expert's first steps warm up anew); not yet with {names}, whose pipeline would switch experts with latents "
    "in flight: leave {them} out (the drained schedule, the default)"
)
CONTROLNET_REFUSED = (
    "this pipeline runs a ControlNet, parallelized on the same ranks as its transformer under ulysses, ring, cfg "
    "and dp (under PipeFusion whole on every rank, each stage taking its blocks' residuals); not yet with {names}: "
    "leave {them} out"
)


def load_refusals(recipe: Recipe, pipeline_class: str, components) -> dict[str, str]:
    """What load_pipeline refuses to combine with `pipeline_class` holding `components` (a folder's), by argument
    (REFUSABLE's keys), each with its reason: a template with {names} and {them} where the reason is the
    pipeline's components (two experts, a ControlNet), a sentence where it is the pipeline class's. The planner
    (plan/rows.py) leaves the rows out that load_pipeline would refuse."""
    refused = {}
    if "transformer_2" in components:
        refused["pipefusion_async"] = TWO_EXPERTS_REFUSED
    if "controlnet" in components:
        # the async schedule would run the ControlNet once per patch, each stage a patch apart
        refused |= dict.fromkeys(("shard_weights", "quantization", "compile", "pipefusion_async"), CONTROLNET_REFUSED)
    if pipeline_class in recipe.step_cache_refused:
        refused["cache"] = (
            f"{pipeline_class} does not run with a StepCache: {recipe.step_cache_refused[pipeline_class]}"
        )
    if pipeline_class in recipe.pipefusion_async_refused:
        refused["pipefusion_async"] = (
            f"{pipeline_class} does not run under pipefusion_schedule='async': "
            f"{recipe.pipefusion_async_refused[pipeline_class]}"
        )
    if pipeline_class in recipe.pipefusion_refused:
        refused["pipefusion"] = (
            f"{pipeline_class} does not run under PipeFusion: {recipe.pipefusion_refused[pipeline_class]}"
        )
    return refused


def refusal_message(refused: dict[str, str], asked) -> str | None:
    """The error for the arguments in `asked` (REFUSABLE's keys) that `refused` (load_refusals) names: the first
    reason, with every asked argument it covers; None where none is refused."""
    hits = [what for what in asked if what in refused]
    if not hits:
        return None
    reason = refused[hits[0]]
    names = [REFUSABLE[what] for what in hits if refused[what] == reason]
    return reason.format(names=", ".join(names), them="it" if len(names) == 1 else "them")
