"""PipeFusion's two schedules: what one denoising step (`session.step()`) runs on a stage.

drained (the default): one transformer call per step runs every patch through every stage, and the
pipeline empties before the scheduler steps (models/step.py's whole step). The bubble is
(N-1)/(M+N-1) of every step, N stages, M patches.

async (`pipefusion_schedule="async"`), past the warmup: every rank still calls step() once per diffusion
step, but step() runs *this rank's stage* through every patch of its next step, and ranks no longer
finish a step together:

    time →       t0    t1    t2    t3    t4    t5          2 stages, 2 patches;
    stage 0     s1p0  s1p1  s2p0  s2p1  ...                s1p0: step 1, patch 0
    stage 1           s1p0  s1p1  s2p0  s2p1
                         └ guide, scheduler step of patch 0, its latents back to stage 0

The last stage guides and steps the scheduler patch by patch (one copy of the scheduler per patch,
so multistep histories stay per patch), and sends each patch's new latents back to stage 0, which
starts the next step on them while later stages finish this one: only the first and last steps
have a bubble, (N-1)/(K·M+N-1) over K pipelined steps. So after step(), only the last stage holds
the step's latents (`latents` on the other ranks lags behind); after the final step they are
broadcast to every rank. With an elementwise scheduler the values equal the drained schedule's:
stage 0 reads the same stale K/V either way. Schedulers that look at the whole sample (dynamic
thresholding), draw noise at each step, or scale the model input by the step are refused by name.
"""

from __future__ import annotations

import copy

import torch

from ... import comm
from ...mesh import PIPEFUSION

# Schedulers that draw noise at every step: stepped once per patch, each patch would draw its own.
NOISY_SCHEDULERS = (
    "CogVideoXDPMScheduler",
    "DDPMScheduler",
    "DPMSolverSDEScheduler",
    "EulerAncestralDiscreteScheduler",
    "KDPM2AncestralDiscreteScheduler",
    "LCMScheduler",
    "TCDScheduler",
)


def async_step(stage, session, t) -> None:
    """The async schedule past its warmup: `stage` (this rank's PipeFusionStage) runs every patch of its
    next step; the last stage steps each patch and sends its latents back to stage 0."""
    inner, prepared, recipe, mesh = session.pipe.diffusers_pipeline, session.prepared, session.recipe, stage.mesh
    latents = prepared.latents = prepared.latents.contiguous()  # written patch by patch, in place
    flat, patches = latents.view(latents.shape[0], -1), stage.config.patches
    if stage.patch_states is None:  # the first pipelined step: every rank holds the same latents
        check_patchwise_scheduler(recipe, inner, prepared, latents, t)
        stage.patch_states = [(copy.deepcopy(inner.scheduler), dict(prepared.extra)) for _ in range(patches)]
    arriving = []
    if stage.awaiting:  # stage 0: this step's latents, patch by patch, from the last stage
        for buffer in stage.awaiting:
            arriving.append((buffer, comm.exchange([], [(buffer, mesh.pipeline_prev)], mesh, PIPEFUSION)))
        stage.awaiting = None
    sent, last_step = [], session.step_index + 1 == session.num_steps
    for p in range(patches):
        if arriving:
            buffer, requests = arriving[p]
            comm.wait(requests)
            if not stage.drops_returned_latents:
                flat[:, stage.patch_latents(latents, p)] = buffer
        model_input = recipe.model_input(inner, prepared, latents, t)  # checked: unscaled
        output = inner.transformer(**recipe.model_kwargs(inner, prepared, model_input, t))
        if not mesh.is_last_stage:
            continue
        noise = recipe.guide(inner, prepared, output[0].clone(), session.step_index)  # the output is a reused buffer
        whole = (inner.scheduler, prepared.extra)
        inner.scheduler, prepared.extra = stage.patch_states[p]
        try:  # a copy: the scheduler may keep the sample it was given, and these latents change in place
            stepped = recipe.scheduler_step(inner, prepared, noise, t, latents.clone(), session.step_index)
            stage.patch_states[p] = (inner.scheduler, prepared.extra)
        finally:
            inner.scheduler, prepared.extra = whole
        elements = stage.patch_latents(latents, p)
        flat[:, elements] = stepped.reshape(flat.shape)[:, elements]
        if not last_step:
            region = flat[:, elements]
            sent += comm.exchange([(region, mesh.pipeline_next)], [], mesh, PIPEFUSION, tag="latents")
    comm.wait(stage.returning)  # the previous step's: stage 0 took them before this step's patches
    stage.returning = sent
    if mesh.is_first_stage and not last_step:  # what the last stage sends back, kept on the stage (reset)
        stage.awaiting = [latents.new_empty(len(latents), len(stage.patch_latents(latents, p))) for p in range(patches)]
    if last_step:  # every rank holds the final latents, as after a drained step
        comm.broadcast(latents, mesh, PIPEFUSION, src_group_rank=stage.config.pipefusion - 1, tag="latents")


def check_patchwise_scheduler(recipe, pipe, prepared, latents: torch.Tensor, t) -> None:
    """Raise unless stepping the scheduler patch by patch (the async schedule) gives what one step over
    the whole latents gives: the step is elementwise, draws no noise, and the model input is not scaled
    by the step (only the last stage steps the scheduler)."""
    scheduler, config = pipe.scheduler, pipe.scheduler.config
    name, found = type(scheduler).__name__, []
    if config.get("thresholding"):
        found.append("its dynamic thresholding takes quantiles over the whole sample")
    noisy = (
        name in NOISY_SCHEDULERS
        or str(config.get("algorithm_type", "")).startswith("sde")
        or config.get("stochastic_sampling")
        or prepared.extra.get("step_kwargs", {}).get("eta", 0)
    )
    if noisy:
        found.append("it draws noise at every step, which each patch would draw apart")
    scaled = recipe.scale_model_input(pipe, latents, t)  # the same tensor back: unscaled, nothing to read
    if scaled is not latents and not torch.equal(scaled.to(latents.dtype), latents):  # once per session
        found.append("it scales the model input by the step, which only the last stage follows")
    if found:
        raise ValueError(
            f"pipefusion_schedule='async' steps the scheduler patch by patch, and {name} cannot be: "
            f"{'; '.join(found)}. Use the drained schedule, or a deterministic scheduler such as "
            f"DPMSolverMultistepScheduler or FlowMatchEulerDiscreteScheduler"
        )
