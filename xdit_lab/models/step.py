"""One denoising step as one transformer call: the step of every token strategy, and PipeFusion's drained
schedule (and its warmup steps under the async one).

    latents ──recipe.model_input: [latents; latents] with guidance──> transformer (parallel) ──> noise [uncond; cond]
            ──recipe.guide──> noise ──recipe.scheduler_step──> the next latents (every rank, whole)

What differs between families (the model's input, its keyword arguments, the guidance, the scheduler's
call) comes from the session's recipe; the session (session.py) calls its strategy's step once per step.
"""

from __future__ import annotations


def whole_step(session, t) -> None:
    """Step `session` (a DenoiseSession) at timestep `t`: every rank ends holding the same latents."""
    inner, prepared, recipe = session.pipe.diffusers_pipeline, session.prepared, session.recipe
    latents = prepared.latents
    model_input = recipe.model_input(inner, prepared, latents, t)
    transformer = recipe.transformer_for(inner, prepared, t)  # Wan 2.2 A14B: its expert for this timestep
    noise = transformer(**recipe.model_kwargs(inner, prepared, model_input, t))[0]
    noise = recipe.guide(inner, prepared, noise, session.step_index)
    prepared.latents = recipe.scheduler_step(inner, prepared, noise, t, latents, session.step_index)
