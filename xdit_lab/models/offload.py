"""Offloaded blocks: a transformer's weights in host memory, N blocks at a time on the device, with diffusers' own
group offloading (diffusers.hooks.group_offloading, what `ModelMixin.enable_group_offload` applies).

    offload_blocks(transformer, 2, device)      # after parallelize: its hooks stay where they are
    offload_groups(transformer)                 # diffusers' groups, read from its hook registries

diffusers cuts every list among the model's children (nn.ModuleList, nn.Sequential: Flux's double- and
single-stream blocks, Wan's blocks, Z-Image's refiners too) into groups of N consecutive elements, and puts
everything else (embeddings, norms, the output projection: the root) in one more group. Each group lives in host
memory and comes to the device only while it runs:

    transformer call   root onloaded ─ group 0 onloaded, runs, offloaded ─ group 1 ... ─ root offloaded
    on the device      the root + one group of N blocks, at most; nothing between calls
    moved to it        every weight once per call (a PipeFusion stage runs the model's forward once per
                       patch: its groups move once per patch, its root once per call)

It comes after parallelize, and composes with what parallelize installs: our hooks on the blocks are torch's
forward hooks, run around diffusers' (which replace the block's `forward`), and the root's group wraps the
parallel forward, so a PipeFusion stage's patches run with the root on the device. A stage offloads only the
blocks it holds: the other stages' blocks were dropped before. A StepCache's wrapper runs inside diffusers' (a
skipped block is still brought over; a stage's first pass, which stops inside block 0, leaves that group on the
device until it runs again). torchao's quantized weights move by diffusers' own path for them. Without an
accelerator the device is the CPU and diffusers moves each group from the CPU to the CPU, which costs nothing
and runs the same hooks.

Not taken (LoadOptions.problems says so before a weight is read): FSDP2's shards (each rank holds 1/N of a
block already and gathers it to the device as it runs) and torch.compile (diffusers moves the weights in
functions compile does not trace, a graph break at every group). unparallelize refuses an offloaded model.

Streams (diffusers' `use_stream=True`, prefetching the next group while one runs) are not used: with them a
rank holds two groups at once and diffusers forces one block per group, so the N asked would not be what runs;
each group's copy waits for the device (blocking copies from pageable memory).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..quantization import stored_bytes

GROUP_OFFLOADING = "group_offloading"  # the name diffusers' registry keeps its hook under (hooks.group_offloading)
OFFLOADED = "_xdit_lab_offload_blocks"  # set on a transformer offload_blocks offloaded: its N


def offload_blocks(transformer: torch.nn.Module, blocks_at_once: int, device) -> torch.nn.Module:
    """Keep `transformer`'s weights in host memory and bring them to `device` a group at a time: its blocks
    `blocks_at_once` at a time, everything outside them with the model's forward (diffusers' block-level group
    offloading, no streams); returns it. Call after parallelize, on a model whose weights are in host memory."""
    if not getattr(transformer, "_supports_group_offloading", False):
        raise ValueError(
            f"{type(transformer).__name__} does not take diffusers' group offloading (its _supports_group_offloading "
            f"is False), so its blocks cannot be offloaded; keep it on the device, or run a PipeFusion stage of it to "
            f"hold fewer blocks"
        )
    transformer.enable_group_offload(
        onload_device=torch.device(device),
        offload_device=torch.device("cpu"),
        offload_type="block_level",
        num_blocks_per_group=blocks_at_once,
    )
    setattr(transformer, OFFLOADED, blocks_at_once)
    return transformer


@dataclass(frozen=True)
class OffloadGroup:
    """One of diffusers' groups on a transformer: the blocks it holds by name ("transformer_blocks.0", ...; the
    root's group: ()), its bytes as the checkpoint holds them (parameters and persistent buffers: what the planner
    reads from the headers; diffusers moves the few buffers computed at construction too, Wan's rotary tables) and
    the module whose forward brings it to the device."""

    blocks: tuple[str, ...]
    bytes: int
    leader: torch.nn.Module = field(repr=False, compare=False)

    @property
    def name(self) -> str:
        return f"{self.blocks[0]}-{self.blocks[-1].rsplit('.', 1)[1]}" if self.blocks else "root"


def offload_groups(transformer: torch.nn.Module) -> list[OffloadGroup]:
    """The groups diffusers' hooks move on `transformer`, read from its modules' hook registries, in the
    model's order, the root's last; [] when it is not offloaded."""
    blocks, root = [], []
    names = {module: name for name, module in transformer.named_modules()}
    stored = {id(t) for t in transformer.state_dict(keep_vars=True).values()}
    seen = set()
    for module in transformer.modules():
        registry = getattr(module, "_diffusers_hook", None)
        hook = registry.get_hook(GROUP_OFFLOADING) if registry is not None else None
        if hook is None or id(hook.group) in seen:
            continue
        group = hook.group
        seen.add(id(group))
        tensors = {id(t): t for m in group.modules for t in (*m.parameters(), *m.buffers())}
        tensors.update({id(t): t for t in (*group.parameters, *group.buffers)})
        size = sum(stored_bytes(t) for key, t in tensors.items() if key in stored)  # quantized: as stored
        if group.offload_leader is transformer:  # the rest of the model: moved with its forward
            root.append(OffloadGroup((), size, transformer))
        else:
            blocks.append(OffloadGroup(tuple(names[m] for m in group.modules), size, group.onload_leader))
    return blocks + root
