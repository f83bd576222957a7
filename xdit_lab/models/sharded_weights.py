"""Sharded weights: torch's FSDP2 over the ranks that hold the same weights.

Without it every rank of a strategy but PipeFusion holds the whole transformer (a PipeFusion stage
holds its own blocks) and every rank holds every text encoder. With it each rank of the weights group
(N ranks: dp × cfg × ring × ulysses, so under PipeFusion the ranks of one stage; text encoders: the
world) keeps 1/N of every parameter, cut on dim 0 as torch.chunk cuts it (the last shards padded), and
a block's whole weights exist only while it runs:

    rank r of N holds W[r·⌈d/N⌉ : (r+1)·⌈d/N⌉] of every parameter W (a DTensor, Shard(0))

    block b-1 pre-forward ── gather block b (prefetched) ──┐
    block b-1 computes                                     │ on a GPU the gather runs on FSDP2's
    block b pre-forward: its gather is done ◄──────────────┘ all-gather stream, beside the compute
    block b computes on the whole W_b, then frees it (reshard_after_forward)

Each FSDP2 unit (a block, then the root's own parameters: embeddings, norms, projections) is gathered
by one all-gather of its padded shards, concatenated. The gathers are FSDP2's own (torch's
`all_gather_single`): comm.weights_all_gather records each in comm_log() and comm_timeline() under the
group, tagged "weights". Per transformer call a rank sends, with P_u the padded shard of unit u:

    bytes_out = (N - 1) × Σ_u gathers_u × Σ_{W in u} ⌈d0(W)/N⌉ × (numel(W) / d0(W)) × element bytes

gathers_u = 1 for every unit under sequence shards, cfg and dp; under PipeFusion past its warmup a
stage runs its blocks once per patch, and each run gathers them again (reshard after every forward):
gathers = patches for the blocks, 1 for the root (weight_gather_bytes, weight_units).

Under tp > 1 the weights group holds one tp coordinate, and each rank's parameters are its tp slices (DTensors on
the tp mesh): FSDP2 shards those slices over the weights group, on a 2-D [weights, tp] DeviceMesh whose children the
two share (RankMesh.device_mesh; torch's FSDP2 + TP layout), so d0 above is the slice's (weight_units).

Sharding comes after parallelize (its hooks are installed first) and composes with every strategy:
FSDP2 prepends its gather to a block's forward pre-hooks and appends its free to its forward hooks,
so every hook parallelize put on a block sees whole weights. A block whose forward ends by an
exception (a PipeFusion stage's last block hands its output on that way; StepCache's first pass stops
after the first block) never reaches FSDP2's free: a forward hook that is always called frees it.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import comm
from ..distributed import current_info
from ..mesh import TP, WEIGHTS, WORLD
from ..quantization import stored_bytes
from ..sharding import gather_buffer_bytes  # noqa: F401 - its closed form, read beside the shards (lab/held.py)
from .installed import Installed

log = logging.getLogger("xdit_lab.models")

TAG = "weights"


@dataclass(frozen=True)
class ShardedWeights:
    """What shard_weights sharded: the group, its size, the FSDP2 units by qualified name (forward
    order, units called outside their block first, the root "" last), or why nothing was."""

    group: str
    group_size: int
    units: tuple[str, ...] = ()
    reason: str | None = None  # why nothing was sharded (a group of one rank), else None

    @property
    def sharded(self) -> bool:
        return bool(self.units)


def shard_weights(
    module, mesh, group: str, blocks, *, separate: Sequence[str] = (), hooks: Installed | None = None
) -> ShardedWeights:
    """Shard `module`'s parameters over the mesh group `group` with torch's FSDP2: `fully_shard` on each
    block, in forward order, then on the root; every unit reshards after its forward (its whole weights
    live only while it runs), and each block prefetches the next one's gather (FSDP2's
    `set_modules_to_forward_prefetch`). Every gather is recorded (comm.weights_all_gather).
    `hooks` (a parallelized model's parallel_state(...).hooks) names the hooks installed beside FSDP2's.

    `blocks`: the repeated layers in the order the forward runs them, one list; or several lists
    (runs whose order relative to each other is unknown, like a text encoder's vision and language
    layers), each prefetching only within itself. `separate`: qualified names of submodules the forward
    calls outside their block, sharded as units of their own first.

    Call it on every rank of the group, after parallelize. On a group of one rank nothing is sharded:
    it warns and returns a ShardedWeights whose `reason` says so.

    reshard_after_forward=True is passed for the root too: left at FSDP2's default (None), the root
    is not resharded (a training heuristic) and its parameters stay whole after the first forward.
    The prefetch overlaps on a GPU (FSDP2's all-gather stream); over gloo it is a blocking gather
    issued when the previous block starts, before that block computes."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    runs = _runs(blocks)
    if not any(runs):
        raise TypeError(
            f"shard_weights found no blocks to shard in {type(module).__name__}: it shards a model's repeated "
            f"layers one by one (pass them as `blocks`, e.g. FamilyAdapter.blocks(transformer), or use "
            f"shard_text_encoder for a transformers text encoder)"
        )
    size = mesh.group_size(group)
    if size == 1:
        reason = (
            f"shard_weights: this rank is the only one in its {group} group ({mesh.config.short()} on "
            f"{mesh.config.world_size} rank(s)): nothing to shard, every parameter stays whole here"
        )
        warnings.warn(reason, stacklevel=2)
        return ShardedWeights(group, 1, (), reason)
    if any(isinstance(m, FSDPModule) for m in module.modules()):
        raise ValueError(f"this {type(module).__name__} is already sharded with fully_shard; shard a fresh one")
    parameter = next(module.parameters(), None)
    if parameter is None or parameter.is_meta:  # built empty, to be filled shard by shard: where it will live
        device_type = current_info().device.type
    else:
        device_type = parameter.device.type
    if device_type == "cpu" and dist.get_backend(mesh.group(group)) == "nccl":
        raise ValueError(
            f"this {type(module).__name__}'s parameters are on the CPU but the {group} group runs NCCL, which "
            f"gathers GPU memory only: move the model to this rank's GPU before parallelize / shard_weights"
        )
    device_mesh = mesh.device_mesh(group, device_type)
    names = {id(m): name for name, m in module.named_modules()}
    units = [module.get_submodule(name) for name in separate]
    units += [block for run in runs for block in run]
    record_again = _transformers_output_recording([*units, module])
    for unit in units:
        fully_shard(unit, mesh=device_mesh, reshard_after_forward=True)
    fully_shard(module, mesh=device_mesh, reshard_after_forward=True)
    units.append(module)
    record_again()
    gather = comm.weights_all_gather(mesh, group, tag=TAG)
    hooks = Installed() if hooks is None else hooks
    for unit in units:
        unit.set_custom_all_gather(gather)
        hooks.forward_hook(f"shard_weights.free[{names[id(unit)]}]", unit, _free_after_exception, always_call=True)
    for run in runs:
        for block, following in zip(run, run[1:]):
            block.set_modules_to_forward_prefetch([following])
    return ShardedWeights(group, size, tuple(names[id(unit)] for unit in units))


def _runs(blocks) -> list[list]:
    """[[block, ...], ...] from one list of blocks or several (a ModuleList counts as one list)."""
    blocks = list(blocks)
    if all(isinstance(b, torch.nn.Module) and not isinstance(b, torch.nn.ModuleList) for b in blocks):
        return [blocks]
    return [list(run) for run in blocks]


def _transformers_output_recording(modules):
    """transformers 5 looks up what a model records for `output_hidden_states` / `output_attentions` by
    the name of its class (`_CAN_RECORD_REGISTRY`, keyed on str(model.__class__)); fully_shard swaps the
    class for FSDP<Name>, and the lookup then finds nothing: hidden_states come back None, silently.
    Returns a function that registers each module's entry again under its new class."""
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:  # another transformers release: nothing keyed on the class to keep
        return lambda: None
    found = [(m, flags) for m in modules if (flags := _CAN_RECORD_REGISTRY.get(m))]

    def record_again():
        for m, flags in found:
            _CAN_RECORD_REGISTRY[m] = flags

    return record_again


def _free_after_exception(module, _args, _output):
    """Always called after the unit's forward, also when it ended by an exception (then FSDP2's own
    post-forward, which frees the gathered weights, did not run). After a normal forward FSDP2 freed
    them already and this does nothing."""
    module.reshard()


def shard_transformer(transformer, state) -> ShardedWeights:
    """parallelize(..., shard_weights=True): the adapter's blocks (a PipeFusion stage: the blocks it
    holds) over the weights group, then the root."""
    adapter = state.adapter
    shards = shard_weights(
        transformer,
        state.mesh,
        WEIGHTS,
        adapter.blocks(transformer),
        separate=adapter.called_outside_their_block,
        hooks=state.hooks,
    )
    if shards.sharded:
        log.info("sharded %s over %s: %d units", type(transformer).__name__, WEIGHTS, len(shards.units))
    return shards


# ---- text encoders ------------------------------------------------------------------------------------


def repeated_layers(module) -> list[tuple[str, torch.nn.ModuleList]]:
    """(name, list) of each outermost nn.ModuleList whose children are all of one class and hold
    parameters: a transformers model's stacked layers (T5's encoder.block, CLIP's encoder.layers,
    Llama's layers, a vision tower's blocks), in the order named_modules finds them."""
    found = []
    for name, child in module.named_modules():
        if not isinstance(child, torch.nn.ModuleList) or len(child) == 0:
            continue
        if len({type(c) for c in child}) != 1 or next(child.parameters(), None) is None:
            continue
        if any(name.startswith(f"{outer}.") for outer, _ in found):
            continue
        found.append((name, child))
    return found


def shard_text_encoder(encoder, mesh) -> ShardedWeights:
    """Shard a transformers text encoder (T5, UMT5, CLIP, Llama, Qwen2.5-VL, Mistral 3 as the tiny
    pipelines build them) over the world group: each of its repeated layers (repeated_layers), then
    the root. Each list of layers prefetches within itself (a vision tower's blocks, which a text
    prompt never runs, are never gathered)."""
    lists = repeated_layers(encoder)
    if not lists:
        raise TypeError(
            f"shard_text_encoder found no repeated layers in {type(encoder).__name__} (no nn.ModuleList of "
            f"same-class children holding parameters); pass its layers to shard_weights yourself"
        )
    return shard_weights(encoder, mesh, WORLD, [list(layers) for _, layers in lists])


# ---- the closed form ----------------------------------------------------------------------------------


def padded_shard_numel(shape: Sequence[int], group_size: int) -> int:
    """Elements of one rank's padded shard of a parameter of `shape`: ⌈d0/N⌉ rows of the rest (FSDP2
    cuts dim 0 with torch.chunk and pads every shard to the first, largest one)."""
    if len(shape) == 0:
        return 1  # a scalar is gathered as one element per rank
    return -(-shape[0] // group_size) * math.prod(shape[1:])


def weight_units(module, blocks, separate: Sequence[str] = ()) -> dict[str, list[tuple[tuple[int, ...], int]]]:
    """{unit name: [(shape, element bytes), ...]} of the FSDP2 units shard_weights makes of an UNSHARDED
    `module` with these blocks: each `separate` submodule, each block, then the root ("") with every
    parameter left (a tied parameter counted once). From the parameter shapes alone, so a cost model
    can build it from a checkpoint's header (on a module made on the meta device)."""
    names = {id(m): name for name, m in module.named_modules()}
    units = [module.get_submodule(name) for name in separate] + [b for run in _runs(blocks) for b in run]
    seen, out = set(), {}
    for unit in units:
        params = [p for p in unit.parameters() if id(p) not in seen]
        seen.update(id(p) for p in params)
        out[names[id(unit)]] = [(_held_shape(p), p.element_size()) for p in params]
    out[""] = [(_held_shape(p), p.element_size()) for p in module.parameters() if id(p) not in seen]
    return out


def _held_shape(parameter) -> tuple[int, ...]:
    """The shape FSDP2 shards of a parameter: a tp-split one's (a DTensor on the tp mesh) is the part this rank
    holds, which FSDP2 cuts on dim 0 over the weights group as it cuts a whole one."""
    return tuple((parameter.to_local() if hasattr(parameter, "to_local") else parameter).shape)


def weight_gather_bytes(
    units: dict[str, list[tuple[tuple[int, ...], int]]], group_size: int, gathers: dict[str, int] | None = None
) -> int:
    """bytes_out one rank records for the "weights" gathers of one call: (N-1) × Σ_u gathers_u ×
    (padded shard bytes of unit u). `units`: weight_units(...); `gathers`: how often each unit is
    gathered per call (default 1; PipeFusion past warmup: the number of patches for each block, 1 for
    the root; DiT's separate conditioning unit: 2, once in its block and once by the output layer)."""
    gathers = gathers or {}
    total = 0
    for name, params in units.items():
        shard = sum(padded_shard_numel(shape, group_size) * element for shape, element in params)
        total += gathers.get(name, 1) * shard
    return (group_size - 1) * total


def local_parameter_bytes(module) -> int:
    """Bytes of parameters this rank holds: a sharded parameter (a DTensor) counts its local shard
    (`p.to_local()`, unpadded; `p.numel()` of a DTensor is the whole parameter's, on every rank), a
    quantized one its int8 or float8 data and scales (quantization.stored_bytes)."""
    return sum(stored_bytes(p) for p in module.parameters())


def held_checkpoint_bytes(module) -> int:
    """Bytes this rank holds of the module's checkpoint, as the memory plan counts them: its parameters
    (local_parameter_bytes) and its persistent buffers, whole (a buffer computed at construction, in no file, is
    in no plan either)."""
    saved = set(module.state_dict())
    return local_parameter_bytes(module) + sum(stored_bytes(b) for name, b in module.named_buffers() if name in saved)


def gathered_numel(parameter) -> int:
    """Elements an FSDP2 gather makes whole of a sharded parameter: the whole parameter's (a DTensor's numel()),
    or under tp this rank's tp slice of it (the parameter's mesh a [weights, tp] one: its tp dim's split left)."""
    numel = parameter.numel()
    mesh = getattr(parameter, "device_mesh", None)
    for dim, placement in enumerate(getattr(parameter, "placements", ())):
        if mesh.mesh_dim_names and mesh.mesh_dim_names[dim] == TP and placement.is_shard():
            numel //= mesh.size(dim)
    return numel


def whole_parameter_bytes(module) -> int:
    """Bytes of the module's parameters whole, whether this rank holds them whole or a shard: a sharded
    parameter by its whole shape (a DTensor's numel() is the whole one's), a quantized one by its stored
    data and scales. On one rank, or with nothing sharded, equal to local_parameter_bytes."""
    return sum(p.numel() * p.element_size() if hasattr(p, "to_local") else stored_bytes(p) for p in module.parameters())
