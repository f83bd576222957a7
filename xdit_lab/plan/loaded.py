"""What a request adds to the load's memory plan, on this rank, before it runs: the tensors a
session keeps from step to step.

    load's plan      weights per component, the VAE decode's peak          (load.plan_memory)
    + latents        prompts × one prompt's latent                          every rank, whole
    + conditioning   rows × one row's text conditioning (+ what no row has)  every rank, gathered
    + image inputs   the encoded images a request starts from (a reference,  every rank, whole
                     inpainting's image and mask, a first frame): one
                     prompt's, and what each more adds
    + stale K/V      PipeFusion's buffers: the stage's layers × its rows     (models/pipefusion/)

Latents and conditioning are whole on every rank (the encode's all-gather hands each rank the
batch's conditioning, and the scheduler steps every prompt's latent), so they are the same under
every configuration. Their bytes per prompt come from the family's own encode and prepare, run for
the request's first prompt (for all of them where a batch pads its text to the longest, Qwen-Image):
no per-family table to fall out of step with diffusers, and the cost of one prompt through the text
encoder. What a step allocates and frees inside the forward is not held between steps and is not
planned here; lab.measure.PeakTensorBytes (CPU) or the CUDA allocator's peak measures it.
rank_memory(pipe) says what a rank holds now, measured: its parameters (a shard's own bytes under
sharded weights) and the allocator's or the process's figures.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from ..families import Request, adapter_for
from ..mesh import CFG, DP
from ..models import parallel_state
from ..models.sharded_weights import local_parameter_bytes
from ..sharding import batch_rows
from .check import MemoryPlan


def held_bytes(value) -> int:
    """Bytes of the tensors in a tensor, or a dict, list or tuple of them (nested); other values count 0."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(held_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(held_bytes(v) for v in value)
    return 0


def one_prompt_bytes(pipe, request: Request) -> tuple[int, int, int, tuple | int]:
    """(latent bytes per prompt, conditioning bytes per prompt over its branches, conditioning bytes
    that no row has, such as Flux's ids, and the encoded image inputs: 0, or (their bytes for the prompts
    prepared, what each prompt more adds, how many were prepared)), from the family's encode and prepare run for the request's first prompt at
    `request`'s size and options (prepare once more for two, where there are images). The pipeline's scheduler
    is restored afterwards."""
    inner, recipe = pipe.diffusers_pipeline, pipe.recipe
    negatives = None if request.negatives is None else request.negatives[:1]  # Flux: true CFG only with negatives
    one = dataclasses.replace(request, prompts=request.prompts[:1], negatives=negatives, generator=None, seed=0)
    if recipe.padded_text:  # every row is padded to the longest text of all prompts: encode them all
        one = dataclasses.replace(request, generator=None, seed=0)
    scheduler = copy.deepcopy(inner.scheduler)  # prepare sets its timesteps
    try:
        with torch.no_grad():
            prepared = recipe.encode(inner, one, pipe.device)
            recipe.prepare(inner, one, prepared, pipe.device)
            images = held_bytes([prepared.extra.get(key) for key in recipe.image_inputs])
            if (
                images
            ):  # prepared again for one more prompt: what each adds (its image latents), what all share (a mask)
                more = dataclasses.replace(one, prompts=one.prompts * 2, negatives=one.negatives and one.negatives * 2)
                again = dataclasses.replace(prepared, extra={})
                recipe.prepare(inner, more, again, pipe.device)
                each = (held_bytes([again.extra.get(key) for key in recipe.image_inputs]) - images) // len(one.prompts)
                images = (images, each, len(one.prompts))
    finally:
        inner.scheduler = scheduler
    unbatched = (*adapter_for(inner.transformer).unbatched, *recipe.unbatched_conditioning)
    conditioning = prepared.conditioning.items()
    per_prompt = held_bytes([value for key, value in conditioning if key not in unbatched]) // len(one.prompts)
    shared = held_bytes([value for key, value in conditioning if key in unbatched])
    latents = held_bytes([prepared.latents, *(prepared.extra.get(key) for key in recipe.latents_beside)])
    return latents // len(one.prompts), per_prompt, shared, images


def plan_request(pipe, request: Request) -> MemoryPlan:
    """The load's plan plus the rows "latents", "conditioning" and what the token strategy keeps between
    steps (PipeFusion: "stale K/V"): what this rank holds once a step of `request` ran, besides the weights."""
    plan = dataclasses.replace(pipe.memory_plan, activation_bytes=dict(pipe.memory_plan.activation_bytes))
    plan.notes = [note for note in pipe.memory_plan.notes if not note.startswith("stale K/V")]  # replaced below
    prompts = len(request.prompts)
    latent, per_prompt, shared, images = one_prompt_bytes(pipe, request)
    plan.activation_bytes["latents"] = (prompts * latent,) * 2
    plan.activation_bytes["conditioning"] = (prompts * per_prompt + shared,) * 2
    branches = 2 if pipe.recipe.do_cfg(request) else 1
    plan.notes.append(f"latents, conditioning: {prompts} prompt(s) × {branches} branch(es), whole on every rank")
    if images:  # a request that starts from an image: its latents (and mask) beside the latents, every step
        first, each, measured = images  # the bytes for the first `measured` prompts, and what each one more adds
        plan.activation_bytes["image inputs"] = (first + (prompts - measured) * each,) * 2
        plan.notes.append(f"image inputs: {prompts} prompt(s)' encoded images kept over the steps, whole on every rank")
    state = parallel_state(pipe.diffusers_pipeline.transformer)
    if state is None:
        return plan
    multiple = pipe.recipe.size_multiple(pipe.diffusers_pipeline)[0]
    height, width = pipe.recipe.drawn_size(pipe.diffusers_pipeline, request)  # an image's bucket (HunyuanVideo-1.5)
    coords = pipe.mesh.group_rank(CFG), pipe.mesh.group_rank(DP)
    start, stop, _ = batch_rows(prompts * branches, pipe.config.cfg, pipe.config.dp, *coords)  # as the forward splits
    frames = pipe.recipe.token_frames(pipe.diffusers_pipeline, request)  # a video's frames stack as rows
    grid = (height // multiple * frames, width // multiple)
    appended = pipe.recipe.appended_grids(pipe.diffusers_pipeline, request)  # an edit's reference images
    kept = state.strategy.report(grid=grid, rows=stop - start, appended=appended).planned_kept_bytes
    for name, n in kept.items():  # what the token strategy keeps between steps (PipeFusion: its stale K/V)
        plan.activation_bytes[name] = (0, n)  # a single rank keeps none of it
        plan.notes.append(
            f"{name}: kept between steps for {prompts} prompt(s) at {height}×{width}"
            + (f", {frames} token frames" if frames > 1 else "")
            + f", {stop - start} row(s) on this rank"
        )
    return plan


def rank_memory(pipe) -> dict:
    """What this rank holds now: parameter bytes per component, and the allocator's (CUDA) or the
    process's (CPU: resident and peak resident set) figures."""
    params = {}
    for name, component in pipe.diffusers_pipeline.components.items():
        if isinstance(component, torch.nn.Module):  # a sharded parameter counts this rank's shard only
            params[name] = local_parameter_bytes(component)
    figures = {"parameter_bytes": params, "parameter_total": sum(params.values())}
    if pipe.device.type == "cuda":
        figures.update(
            allocated=torch.cuda.memory_allocated(pipe.device),
            max_allocated=torch.cuda.max_memory_allocated(pipe.device),
            reserved=torch.cuda.memory_reserved(pipe.device),
        )
    else:
        try:
            with open("/proc/self/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
            figures.update(rss=int(status["VmRSS"].split()[0]) * 1024, peak_rss=int(status["VmHWM"].split()[0]) * 1024)
        except (OSError, KeyError):
            pass
    return figures
