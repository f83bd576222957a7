"""One denoising step as one transformer call: the step of every token strategy, and PipeFusion's drained
schedule (and its warmup steps under the async one).

    latents ──recipe.model_input: [latents; latents] with guidance──> transformer (parallel)
            ──recipe.prediction──> noise [uncond; cond]
            ──recipe.guide──> noise ──recipe.scheduler_step──> the next latents (every rank, whole)

What differs between families (the model's input, its keyword arguments, the guidance, the scheduler's
call) comes from the recipe; the session (session.py) calls its strategy's step once per step, with the
step's StepContext (models/strategy.py).
"""

from __future__ import annotations


def whole_step(context, t) -> None:
    """One step at timestep `t` (`context`: a StepContext): every rank ends holding the same latents."""
    inner, prepared, recipe = context.pipeline, context.prepared, context.recipe
    latents = prepared.latents
    model_input = recipe.model_input(inner, prepared, latents, t)
    transformer = recipe.transformer_for(inner, prepared, t)  # Wan 2.2 A14B: its expert for this timestep
    noise = recipe.prediction(inner, prepared, transformer(**recipe.model_kwargs(inner, prepared, model_input, t)))
    noise = recipe.guide(inner, prepared, noise, context.step_index)
    prepared.latents = recipe.scheduler_step(inner, prepared, noise, t, latents, context.step_index)
