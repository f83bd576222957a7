"""One denoising step as one transformer call: the step of every token strategy, and PipeFusion's drained
schedule (and its warmup steps under the async one).

    latents ──[latents; latents] with guidance──> transformer (parallel) ──> noise [uncond; cond]
            ──recipe.guide──> noise ──recipe.scheduler_step──> the next latents (every rank, whole)

What differs between families (the model's input, its keyword arguments, the guidance, the scheduler's
call) comes from the session's recipe; the session (session.py) calls its strategy's step once per step.
"""

from __future__ import annotations

import torch


def whole_step(session, t) -> None:
    """Step `session` (a DenoiseSession) at timestep `t`: every rank ends holding the same latents."""
    inner, prepared, recipe = session.pipe.diffusers_pipeline, session.prepared, session.recipe
    latents = prepared.latents
    model_input = recipe.scale_model_input(inner, model_batch(latents, prepared.do_cfg), t)
    noise = inner.transformer(**recipe.model_kwargs(inner, prepared, model_input, t))[0]
    noise = recipe.guide(inner, prepared, noise, session.step_index)
    prepared.latents = recipe.scheduler_step(inner, prepared, noise, t, latents, session.step_index)


def model_batch(latents, do_cfg: bool):
    """The model's batch: [latents; latents] for the two branches [unconditional; conditional] with guidance."""
    return torch.cat([latents, latents]) if do_cfg else latents
