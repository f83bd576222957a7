"""What a rank holds of each component, read from the modules themselves, and the load's plan beside it:
rank_summary's memory["components"], memory["weight_gather_bytes"] and memory["plan"].

    rank r of N, shard_weights=True, text_encoder_2 kept in host memory (on_host):

    component        where    held by rank r                                  of the whole
    transformer      device   p.to_local() of every parameter (FSDP2, Shard(0))   ~1/N   group "weights"
                              + its persistent buffers, whole
    text_encoder     device   the same, sharded over the world                   ~1/N   group "world"
    text_encoder_2   host     every parameter whole, in host memory              1
    vae              device   every parameter whole                              1

    weight gathers   the whole copies a sharded forward holds at once, from this rank's FSDP2 units:
                     max(3 × largest block unit, 2 × largest + root) + root (models/sharded_weights.py)

Every number is counted tensor by tensor from what the rank has now (a DTensor's local shard, unpadded;
a buffer whole), not from the plan. The plan (pipe.memory_plan, from the safetensors headers before a
byte was read: the busiest rank) is reported apart, term by term, for the view to draw beside it.
"""

from __future__ import annotations

import torch

from ..models.offload import OFFLOADED, offload_groups
from ..models.sharded_weights import (
    gather_buffer_bytes,
    gathered_numel,
    local_parameter_bytes,
    whole_parameter_bytes,
)
from ..pipeline import ON_HOST
from ..quantization import quantized_form


def _is_sharded(p) -> bool:
    return hasattr(p, "to_local")  # a DTensor: FSDP2's sharded parameter


def persistent_buffers(module) -> list[torch.Tensor]:
    """The buffers a checkpoint saves (each submodule's, less its non-persistent ones: rotary tables,
    position ids computed at construction), each once."""
    seen, found = set(), []
    for sub in module.modules():
        for name, buffer in sub._buffers.items():
            if buffer is None or name in sub._non_persistent_buffers_set or id(buffer) in seen:
                continue
            seen.add(id(buffer))
            found.append(buffer)
    return found


def fsdp_unit_bytes(module) -> dict[str, int]:
    """{FSDP2 unit name: whole bytes of the parameters it gathers} ("" the root, the parameters outside
    every other unit); empty for a module that is not sharded. A DTensor's numel() is the whole
    parameter's, on every rank; under tp what FSDP2 gathers is this rank's tp slice (gathered_numel)."""
    from torch.distributed.fsdp import FSDPModule

    units = [name for name, m in module.named_modules() if isinstance(m, FSDPModule)]
    if not units:
        return {}
    found = dict.fromkeys(units, 0)
    for name, p in module.named_parameters():  # each parameter to the innermost unit that holds it
        unit = max((u for u in units if u == "" or name.startswith(f"{u}.")), key=len)
        found[unit] += gathered_numel(p) * p.element_size()
    return found


def holding(component) -> dict:
    """What this rank holds of one component (an nn.Module): bytes held (local parameter shards and
    persistent buffers), the whole's bytes, whether FSDP2 shards it and over which mesh group and how
    many ranks, the share held, whether it is kept in host memory (pipeline.run_on_host), the device
    of its parameters, the gather buffer its sharded forward holds (0 when whole), the schemes its
    quantized weights are stored in (load_pipeline(quantization=...): torchao's, by their inner tensors),
    and with offloaded blocks (load_pipeline(offload_blocks=N)) its N and the most it has on the device at once:
    device_bytes, diffusers' root group and largest group of blocks (0 on the host, else held_bytes)."""
    params = list(component.parameters())
    buffers = persistent_buffers(component)
    local, whole = local_parameter_bytes(component), whole_parameter_bytes(component)
    buffered = sum(b.nbytes for b in buffers)
    sharded = [p for p in params if _is_sharded(p)]
    mesh = sharded[0].device_mesh if sharded else None
    units = fsdp_unit_bytes(component)
    blocks = [size for name, size in units.items() if name != ""]
    gather = gather_buffer_bytes(max(blocks, default=0), units.get("", 0)) if sharded else 0
    first = next(iter(params), None)
    on_host = bool(getattr(component, ON_HOST, False))
    groups = offload_groups(component)
    device = 0 if on_host else local + buffered
    if groups:  # in host memory, a group of blocks at a time on the device with the root's group
        device = groups[-1].bytes + max((g.bytes for g in groups if g.blocks), default=0)
    return dict(
        held_bytes=local + buffered,
        whole_bytes=whole + buffered,
        parameter_bytes=local,
        sharded=bool(sharded),
        group=mesh.mesh_dim_names[0] if mesh is not None and mesh.mesh_dim_names else None,
        shards=mesh.size(0) if mesh is not None else 1,  # FSDP2's dim of a [weights, tp] mesh
        fraction=(local + buffered) / (whole + buffered) if whole + buffered else 1.0,
        on_host=on_host,
        offloaded=getattr(component, OFFLOADED, None),
        device_bytes=device,
        device=str((first.to_local() if _is_sharded(first) else first).device) if first is not None else None,
        gather_bytes=gather,
        quantized=sorted({form for p in params if (form := quantized_form(p)) is not None}),
    )


def component_holdings(pipe) -> dict[str, dict]:
    """holding() of every nn.Module component of the pipeline this rank loaded."""
    return {
        name: holding(component)
        for name, component in pipe.diffusers_pipeline.components.items()
        if isinstance(component, torch.nn.Module)
    }


def plan_terms(plan) -> dict:
    """The load's MemoryPlan as plain numbers: what one rank (the busiest) holds per component on its
    device, each whole, the activation terms per rank ("weight gathers", "decode peak", "stale K/V"),
    the decode's peak on one rank decoding whole (beside the per-rank one, in bands where the ranks share an
    image; None without a planned decode), the components kept in host memory (planned 0 on the device, their
    whole in host memory), the notes."""
    host = [name for name, size in plan.per_rank_bytes.items() if size == 0 and plan.component_bytes.get(name)]
    return dict(
        per_rank_bytes=dict(plan.per_rank_bytes),
        component_bytes=dict(plan.component_bytes),
        activation_bytes={name: per_rank for name, (_, per_rank) in plan.activation_bytes.items()},
        decode_peak_whole=plan.activation_bytes.get("decode peak", (None,))[0],
        on_host=host,
        notes=list(plan.notes),
    )
