"""A load's memory plan: the planner's row for the load's configuration and placement (plan_row, the row
`xdit-lab plan --model` prints for them), as the MemoryPlan load_pipeline checks and `pipe.memory_plan` shows.

    row (plan_row)                    MemoryPlan
      weights, per component     ->   per_rank_bytes (component_bytes: each whole)
      stale K/V                  ->   activation_bytes["stale K/V"]       (0 on one rank, the row's per rank)
      decode peak                ->   activation_bytes["decode peak"]     (whole, the row's in row bands)
      gather buffer              ->   activation_bytes["weight gathers"]  (0 on one rank, the row's per rank)
      offloaded transformer      ->   per_rank_bytes: its root and largest group of blocks; a note with the
                                      bytes in host memory and moved to the device per step

The request terms are planned for one prompt at the folder's call defaults (terms.load_call); the latents and
conditioning of a real request are added by pipe.memory_plan_for (loaded.plan_request).
"""

from __future__ import annotations

import torch

from ..config import ParallelConfig
from ..model_folder import EXPERT, TRANSFORMER, ModelFolder, ModelFolderError, read_call_defaults, read_model_folder
from .check import MemoryPlan, human_bytes
from .rows import offloaded_words, plan_row
from .terms import decode_peak_bytes, kv_rows, load_call, request_shape


def plan_memory(
    folder,
    components: list[str] | None = None,
    *,
    dtype: torch.dtype,
    config: ParallelConfig | None = None,
    ranks_per_host: int = 1,
    shard_weights: bool = False,
    on_host: tuple[str, ...] = (),
    quantized=None,
    offload: int | None = None,
    call_defaults: dict | None = None,
    request: bool = False,
) -> MemoryPlan:
    """What one rank holds of `folder` (a path, or the load's ModelFolder in the load dtype) under `config`
    (default: one rank): the planner's row for this configuration and placement, as a MemoryPlan of
    `components` (default: every component the index lists). `shard_weights`: FSDP2 over the ranks that hold
    the same blocks (text encoders over the world); `on_host`: text encoders kept in host memory; `quantized`:
    load_pipeline's resolved quantization (a named scheme is planned quantized; another config at the load
    dtype, said so); `offload` (offload_blocks' N): the transformer's blocks in host memory, N at a time on the
    device. With `request` (load_pipeline's), the stale K/V and the decode peak of one prompt at
    `call_defaults` (default: the family's and the folder's)."""
    config = ParallelConfig() if config is None else config
    model = folder if isinstance(folder, ModelFolder) else read_model_folder(folder, dtype)
    components = model.components if components is None else components
    sharding = shard_weights and config.world_size > 1
    placement = {name: "host" if name in on_host else "sharded" if sharding else "gpu" for name in model.text_encoders}
    scheme = quantized.scheme if quantized is not None else None
    covered = tuple(quantized.configs) if scheme is not None else ()
    call = shape = None
    notes = []
    if request:
        if call_defaults is None:
            recipe = model.recipe
            call_defaults = {**recipe.call_defaults(model.pipeline_class), **read_call_defaults(model.path, recipe)}
        try:
            call = load_call(model, call_defaults)
            shape = request_shape(model, call)
        # every family's recipe has its closed form; a folder without a VAE, or call defaults at a size the VAE and
        # patches do not divide, leave the request terms unplanned, said in the notes
        except (ModelFolderError, ValueError) as error:
            notes.append(f"stale K/V and decode peak not planned: {error}")
            call = None
    row = plan_row(
        model, config, shard=sharding, placement=placement, quantize=scheme, quantized=covered, call=call, shape=shape,
        offload=offload,
    )  # fmt: skip
    whole = {name: model.weights[name].whole if name in model.weights else 0 for name in components}
    plan = MemoryPlan(whole, {name: row.weights.get(name, 0) for name in components}, ranks_per_host)
    if "transformer" in components and model.transformer.blocks:  # what PipeFusion's advice splits
        transformer = model.transformer
        plan.transformer_blocks = (
            sum(t.nbytes for t in transformer.root),
            [sum(t.nbytes for t in block) for block in transformer.blocks],
        )
    if row.stale_kv and "transformer" in components:
        plan.activation_bytes["stale K/V"] = (0, row.stale_kv)  # a single rank keeps no stale K/V
        plan.notes.append(
            f"stale K/V: PipeFusion's buffers for one prompt at the default size, "
            f"{kv_rows(config, call.prompts * call.branches)} row(s)"
        )
    if row.decode_peak is not None and "vae" in components:
        latent = (1, *shape.decode_latent)
        plan.activation_bytes["decode peak"] = (
            decode_peak_bytes(model.configs["vae"], latent, model.element),
            row.decode_peak,
        )
        plan.notes.append(f"decode peak: one image of a {latent[2]}×{latent[3]} latent")
    if row.gather:
        plan.activation_bytes["weight gathers"] = (0, row.gather)  # a single rank gathers nothing
        plan.notes.append(
            f"weights sharded over {config.world_size // config.pipefusion} rank(s) of a stage (text encoders over "
            f"{config.world_size}); weight gathers: the largest blocks and the root a sharded forward holds whole"
        )
    plan.offloaded, plan.host_bytes = row.offload_blocks, row.host_bytes
    if row.offload_blocks:
        transformers = [name for name in model.named(TRANSFORMER, EXPERT) if name in components]
        plan.notes.append(
            f"{offloaded_words(row.offload_blocks).replace('GPU', 'device')}: {', '.join(transformers)} in host "
            f"memory but for the root and the largest group of {row.offload_blocks} block(s) "
            f"({human_bytes(row.weights['transformer'])} on the device), {human_bytes(row.offload_traffic)} moved "
            f"host to device per step (diffusers' group offloading)"
        )
    if on_host or row.offload_blocks:
        host = ", ".join([*on_host, *(["the offloaded transformer"] if row.offload_blocks else [])])
        plan.notes.append(f"in host memory, not on the device: {host} ({human_bytes(row.host_bytes)})")
    if scheme is not None:
        plan.notes.append(f"{scheme} weight-only (torchao): the linear weights of {', '.join(covered)}")
    elif quantized is not None:
        plan.notes.append(
            f"quantized with a config that is no named scheme, or with modules_to_not_convert: "
            f"{', '.join(quantized.configs)} planned at the load dtype (more than they will hold)"
        )
    plan.notes.extend(notes)
    return plan
