"""PipeFusion's two schedules: what one denoising step (`session.step()`, which hands the stage a
StepContext) runs on a stage.

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
from ...sharding import patch_ranges

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


class AsyncSchedule:
    """The async schedule's bookkeeping on one stage, owned by it (PipeFusionStage.schedule): which patch
    the next transformer call runs, the sends in flight, the latents travelling back to stage 0, and one
    scheduler per patch. A stage of the drained schedule has none."""

    def __init__(self, stage):
        self.stage = stage  # this rank's PipeFusionStage
        self.cursor = 0  # the patch the next call runs
        self.pending_sends: list = []  # this step's sends, waited once its last patch has gone
        self.latent_elements: dict = {}  # (latent shape, patch) -> that patch's flat latent positions
        self.awaiting = None  # stage 0: buffers for the latents the last stage has sent back
        self.returning: list = []  # the last stage: its sends of latents back to stage 0
        self.patch_states = None  # (scheduler, recipe extras) per patch, on every rank

    def step(self, context, t) -> None:
        """The async schedule past its warmup (`context`: the step's StepContext): this rank's stage runs
        every patch of its next step; the last stage steps each patch and sends its latents back to stage 0."""
        stage = self.stage
        inner, prepared, recipe, mesh = context.pipeline, context.prepared, context.recipe, stage.mesh
        latents = prepared.latents = prepared.latents.contiguous()  # written patch by patch, in place
        flat, patches = latents.view(latents.shape[0], -1), stage.config.patches
        if self.patch_states is None:  # the first pipelined step: every rank holds the same latents
            check_patchwise_scheduler(recipe, inner, prepared, latents, t)
            self.patch_states = [(copy.deepcopy(inner.scheduler), dict(prepared.extra)) for _ in range(patches)]
        arriving = []
        if self.awaiting:  # stage 0: this step's latents, patch by patch, from the last stage
            for buffer in self.awaiting:
                arriving.append((buffer, comm.exchange([], [(buffer, mesh.pipeline_prev)], mesh, PIPEFUSION)))
            self.awaiting = None
        sent, last_step = [], context.last
        for p in range(patches):
            if arriving:
                buffer, requests = arriving[p]
                comm.wait(requests)
                if not stage.state.controls.drops_returned_latents:
                    flat[:, self.patch_latents(latents, p)] = buffer
            model_input = recipe.model_input(inner, prepared, latents, t)  # checked: unscaled
            output = inner.transformer(**recipe.model_kwargs(inner, prepared, model_input, t))
            if not mesh.is_last_stage:
                continue
            # a copy: the output is a reused buffer (a tensor, or one per sample: Z-Image's list)
            noise = torch.utils._pytree.tree_map(torch.clone, output[0])
            noise = recipe.guide(inner, prepared, noise, context.step_index)
            whole = (inner.scheduler, prepared.extra)
            inner.scheduler, prepared.extra = self.patch_states[p]
            try:  # a copy: the scheduler may keep the sample it was given, and these latents change in place
                stepped = recipe.scheduler_step(inner, prepared, noise, t, latents.clone(), context.step_index)
                self.patch_states[p] = (inner.scheduler, prepared.extra)
            finally:
                inner.scheduler, prepared.extra = whole
            elements = self.patch_latents(latents, p)
            flat[:, elements] = stepped.reshape(flat.shape)[:, elements]
            if not last_step:
                region = flat[:, elements]
                sent += comm.exchange([(region, mesh.pipeline_next)], [], mesh, PIPEFUSION, tag="latents")
        comm.wait(self.returning)  # the previous step's: stage 0 took them before this step's patches
        self.returning = sent
        if mesh.is_first_stage and not last_step:  # what the last stage sends back, kept here (reset)
            sizes = [len(self.patch_latents(latents, p)) for p in range(patches)]
            self.awaiting = [latents.new_empty(len(latents), size) for size in sizes]
        if last_step:  # every rank holds the final latents, as after a drained step
            comm.broadcast(latents, mesh, PIPEFUSION, src_group_rank=stage.config.pipefusion - 1, tag="latents")

    def end_patch(self, sends, output):
        """This call's patch is done. A stage's sends are waited once the step's last patch has gone (a
        stage runs ahead of the next one by at most a step); only the last stage has an output: the whole
        prediction, in which this patch's tokens are this step's."""
        self.pending_sends += sends
        self.cursor += 1
        if self.cursor == len(self.stage.layout.patches):
            comm.wait(self.pending_sends)
            self.cursor, self.pending_sends = 0, []
            self.stage.step += 1
        return output

    def patch_latents(self, latents: torch.Tensor, patch: int) -> torch.Tensor:
        """Flat positions in one sample of `latents` that make up `patch` (on the latents' device): its band of
        the drawn image (the latents hold no reference image's tokens)."""
        stage = self.stage
        key = (tuple(latents.shape[1:]), patch)
        if key not in self.latent_elements:  # the grid is known once a forward ran on this size: the latest's
            start, stop = patch_ranges(*stage.grid[0], stage.config.patches)[patch]
            positions = stage.state.adapter.latents.latent_positions(latents, stage.model_config)
            self.latent_elements[key] = positions[start:stop].flatten()
        return self.latent_elements[key]

    def reset(self) -> None:
        """A new generation. A session left between steps has latents in flight from the last stage to
        stage 0: they are taken and dropped here, or the next session's receives would get them."""
        mesh = self.stage.mesh
        if self.awaiting:
            received = [(buffer, mesh.pipeline_prev) for buffer in self.awaiting]
            comm.wait(comm.exchange([], received, mesh, PIPEFUSION))
        comm.wait(self.returning)
        self.cursor, self.pending_sends, self.awaiting, self.returning = 0, [], None, []
        self.patch_states = None


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
