"""A load's memory plan (MemoryPlan: bytes per component per rank, and the activations beside them) checked
against the memory each rank really has, before a byte of weights is read: check_plan fails with the numbers
and what to change (bfloat16, a PipeFusion degree whose largest stage fits, the decode in row bands, fewer
ranks per host)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from ..config import ParallelConfig


class MemoryPlanError(MemoryError):
    """The plan does not fit the memory a rank has; the message holds the numbers."""


@dataclass
class MemoryPlan:
    component_bytes: dict[str, int]  # whole component, as loaded
    per_rank_bytes: dict[str, int]  # what one rank holds
    ranks_per_host: int = 1
    notes: list[str] = field(default_factory=list)
    # activations on top of the weights, as (serial, per rank): "decode peak" (the VAE's), and for a
    # request (ParallelPipeline.memory_plan_for) "latents", "conditioning", "stale K/V" (PipeFusion's)
    activation_bytes: dict[str, tuple[int, int]] = field(default_factory=dict)
    # the transformer as PipeFusion splits it: bytes every stage keeps, and each block's bytes
    transformer_blocks: tuple[int, list[int]] | None = None
    offloaded: int | None = None  # offload_blocks: the transformer's blocks in host memory, this many on the device
    host_bytes: int = 0  # what one rank keeps in host memory, not on its device (on_host, an offloaded transformer)

    @property
    def total_per_rank(self) -> int:
        return sum(self.per_rank_bytes.values()) + sum(per_rank for _, per_rank in self.activation_bytes.values())

    def table(self) -> str:
        lines = [f"  {'component':<16} {'whole':>12} {'per rank':>12}"]
        for name, whole in self.component_bytes.items():
            lines.append(f"  {name:<16} {human_bytes(whole):>12} {human_bytes(self.per_rank_bytes[name]):>12}")
        for name, (serial, per_rank) in self.activation_bytes.items():
            lines.append(f"  {name:<16} {human_bytes(serial):>12} {human_bytes(per_rank):>12}")
        whole = sum(self.component_bytes.values()) + sum(serial for serial, _ in self.activation_bytes.values())
        lines.append(f"  {'total':<16} {human_bytes(whole):>12} {human_bytes(self.total_per_rank):>12}")
        return "\n".join(lines + [f"  ({note})" for note in self.notes])


def available_bytes(device: torch.device) -> int:
    """Free memory for one rank: free GPU memory, or the host's available RAM shared by its ranks.

    On CUDA the device's free memory does not count what torch's caching allocator holds for this
    process without using it (blocks of a model freed before a reload): those are free to us too."""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def check_plan(plan: MemoryPlan, device: torch.device, *, limit_bytes: int | None = None, config=None) -> None:
    """Fail before loading when one rank's share does not fit, with the numbers and what to change: on its device,
    and on a GPU what it keeps in host memory (plan.host_bytes) beside the other ranks of its host. On a CPU the
    host is the device: what is kept "in host memory" counts there too."""
    if limit_bytes is None:
        limit_bytes = available_bytes(device)
        if device.type == "cpu":
            limit_bytes //= max(1, plan.ranks_per_host)  # CPU ranks on one host share its RAM
    needed = plan.total_per_rank + (plan.host_bytes if device.type == "cpu" else 0)
    if needed <= limit_bytes:
        if device.type != "cpu" and plan.host_bytes:
            _check_host(plan)
        return
    advice = ["load in bfloat16 (torch_dtype=torch.bfloat16) to halve float32 weights"]
    if plan.transformer_blocks is not None:
        advice.append(_pipefusion_advice(plan, limit_bytes, config.pipefusion if config is not None else 1))
    # on a CPU the host is the device: blocks kept "in host memory" would count there all the same
    if plan.transformer_blocks is not None and plan.offloaded is None and device.type != "cpu":
        shared, blocks = plan.transformer_blocks
        advice.append(
            f"keep the transformer's blocks in host memory, one at a time on the device (offload_blocks=1): "
            f"{human_bytes(shared + max(blocks, default=0))} of it on the device per rank, all of it moved there "
            f"each step"
        )
    if "decode peak" in plan.activation_bytes:
        serial, per_rank = plan.activation_bytes["decode peak"]
        if per_rank == serial:
            advice.append(
                f"the VAE decode's peak ({human_bytes(serial)}) splits in row bands over the ranks that share an image "
                f"(ulysses, ring or pipefusion above 1, with vae_parallel=True, the default)"
            )
    if device.type == "cpu" and plan.ranks_per_host > 1:
        advice.append(f"run fewer ranks per host ({plan.ranks_per_host} share this host's memory now)")
    where = f"{device}" + (f" under {config.short()}" if config is not None else "")
    host = (
        f" (and {human_bytes(plan.host_bytes)} in host memory, here the same)" if needed > plan.total_per_rank else ""
    )
    raise MemoryPlanError(
        f"the pipeline needs {human_bytes(plan.total_per_rank)}{host} per rank on {where}, but only "
        f"{human_bytes(limit_bytes)} is available per rank:\n{plan.table()}\nTo fit: " + "; or ".join(advice) + "."
    )


def _check_host(plan: MemoryPlan) -> None:
    """What the ranks of a GPU host keep in its memory (text encoders on_host, offloaded transformers) against the
    RAM it has, shared by those ranks."""
    ranks = max(1, plan.ranks_per_host)
    free = available_bytes(torch.device("cpu")) // ranks
    if plan.host_bytes > free:
        raise MemoryPlanError(
            f"the pipeline keeps {human_bytes(plan.host_bytes)} per rank in host memory (text encoders on_host, an "
            f"offloaded transformer), but this host has {human_bytes(free)} available per rank ({ranks} rank(s) share "
            f"it):\n{plan.table()}\nTo fit: run fewer ranks per host, keep fewer text encoders on the host, or "
            f"shard the weights instead of offloading them (xdit-lab plan --model says what fits)."
        )


def _pipefusion_advice(plan: MemoryPlan, limit_bytes: int, current: int) -> str:
    """The smallest PipeFusion degree above `current` whose largest stage fits, counting what every
    stage keeps (embeddings, output layers) besides its blocks; or what the most stages would hold."""
    shared, blocks = plan.transformer_blocks
    others = plan.total_per_rank - plan.per_rank_bytes["transformer"]

    def stage_bytes(stages):
        return shared + max(
            sum(blocks[start:stop]) for start, stop in ParallelConfig(pipefusion=stages).stage_ranges(len(blocks))
        )

    degrees = range(max(2, current + 1), len(blocks) + 1)
    fitting = [n for n in degrees if others + stage_bytes(n) <= limit_bytes]
    kept = f"{human_bytes(shared)} outside the blocks on every stage"
    if fitting:
        n = fitting[0]
        return (
            f"PipeFusion splits the transformer's {len(blocks)} blocks over stages: pipefusion {n} holds "
            f"{human_bytes(stage_bytes(n))} of it per rank ({kept})"
        )
    if not degrees:
        return f"PipeFusion cannot split the transformer's {len(blocks)} blocks further than pipefusion {current}"
    most = len(blocks)
    return (
        f"PipeFusion alone does not fit it: even pipefusion {most} (one block per stage) holds "
        f"{human_bytes(stage_bytes(most))} of the transformer per rank ({kept})"
    )


def human_bytes(n: float) -> str:
    """'1.5 MB': decimal units (10³, 10⁶, 10⁹ bytes), as GPU vendors sell memory and the planner counts it."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"
