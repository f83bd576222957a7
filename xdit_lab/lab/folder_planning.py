"""The explorer's planning mode for a model folder: which way to run it fits N GPUs of a given memory.

    plan_folder("flux-dev", 4, "24GB")   every configuration × weights whole or sharded, the text encoders
                                         with them or in host memory (xdit_lab.plan.plan_model,
                                         from the folder's configs and safetensors headers alone), best
                                         first; when nothing fits, the smallest GPU memory that would
    folder_plan_html(plan)               the same as the table the panel shows

Pure functions, tested without engines (tests/test_memory_view.py); the explorer's panel only shows
what they return. Sizes are GB (10⁹ bytes) per rank, as `xdit-lab plan --model` prints them.
"""

from __future__ import annotations

import argparse
import html
from dataclasses import dataclass
from pathlib import Path

from ..plan import GB, FitRow, plan_model, smallest_fit
from ..plan.command import memory_size


@dataclass(frozen=True)
class FolderPlanRow:
    """One way to run the model, as the panel's table shows it."""

    config: str  # ParallelConfig.short(): "ulysses4", "cfg2·pf2", ...
    sharded: bool  # the transformer's weights sharded with FSDP2 over the ranks that hold the same ones
    text_encoders: str  # "gpu" (whole on every GPU), "sharded" (FSDP2 over the world) or "host"
    gb_per_rank: float  # what one rank holds, every known term (FitRow.per_rank_bytes / 10⁹)
    fits: bool


@dataclass(frozen=True)
class FolderPlan:
    """The rows for `gpus` GPUs of `gpu_memory_bytes`, best first (fitting rows first, then the cost
    model's ranking: xdit_lab.plan.fit_rank_key), and what to buy when nothing fits."""

    heading: str  # the model and request planned for, and the GPUs
    rows: tuple[FolderPlanRow, ...]  # every row, best first
    gpus: int
    gpu_memory_bytes: int
    smallest_fit_bytes: int | None  # when nothing fits: the least GPU memory one rank would need
    smallest: str | None  # ... said in words: how much, under which configuration and placement
    notes: tuple[str, ...]

    @property
    def fits(self) -> bool:
        return any(row.fits for row in self.rows)


def gpu_memory_bytes(gpu_memory) -> int:
    """One GPU's memory: bytes (an int), or text as `xdit-lab plan --gpu-memory` takes it ('24GB' is
    24·10⁹ bytes, '22.5GiB' 22.5·2³⁰); a clear ValueError otherwise."""
    if isinstance(gpu_memory, bool) or not isinstance(gpu_memory, (int, str)):
        raise ValueError(f"the GPU memory is a size such as '24GB' or a number of bytes, got {gpu_memory!r}")
    if isinstance(gpu_memory, int):
        if gpu_memory < 1:
            raise ValueError(f"the GPU memory must be at least one byte, got {gpu_memory}")
        return gpu_memory
    try:
        return memory_size(gpu_memory)
    except argparse.ArgumentTypeError as error:
        raise ValueError(f"GPU memory: {error}") from None


def plan_folder(folder, gpus: int, gpu_memory, **request) -> FolderPlan:
    """plan_model(folder, gpus, gpu_memory) as the panel shows it (`request`: plan_model's height,
    width, batch, use_cfg, options, dtype). Raises ValueError saying what is wrong with the folder,
    the GPU count or the memory."""
    if not str(folder).strip():
        raise ValueError("give a model folder to plan (a diffusers folder with model_index.json)")
    folder = Path(str(folder).strip()).expanduser()
    if not (folder / "model_index.json").is_file():
        raise ValueError(
            f"{folder} is not a diffusers model folder (no model_index.json there); give the folder that "
            f"holds it, e.g. one written by xdit_lab.real_models.save_header_only('FLUX.1-dev', path)"
        )
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"plan for a positive number of GPUs, got {gpus!r}")
    memory = gpu_memory_bytes(gpu_memory)
    try:
        rows = plan_model(folder, gpus, memory, **request)
    except OSError as error:  # an unreadable file: the folder's, not ours
        raise ValueError(f"{folder} could not be read: {error}") from None
    planned = rows[0].request
    smallest = None if any(row.fits for row in rows) else smallest_fit(rows)
    return FolderPlan(
        heading=f"{planned.describe()}; {gpus} GPU(s) of {memory / GB:.3g} GB each",
        rows=tuple(_row(row) for row in rows),
        gpus=gpus,
        gpu_memory_bytes=memory,
        smallest_fit_bytes=None if smallest is None else smallest.per_rank_bytes,
        smallest=None if smallest is None else _smallest_text(smallest, gpus, memory),
        notes=tuple(dict.fromkeys([*planned.notes, *rows[0].unknown])),
    )


def _row(row: FitRow) -> FolderPlanRow:
    return FolderPlanRow(row.config.short(), row.shard_weights, row.text_encoders, row.per_rank_bytes / GB, row.fits)


def _smallest_text(row: FitRow, gpus: int, memory: int) -> str:
    return (
        f"nothing fits {gpus} × {memory / GB:.3g} GB: the smallest GPU that would is {row.per_rank_bytes / GB:.2f} GB, "
        f"under {row.config.short()} with "
        f"{'sharded' if row.shard_weights else 'whole'} weights and text encoders {row.text_encoders}"
    )


def folder_plan_html(plan: FolderPlan, top: int | None = None) -> str:
    """The plan as the panel shows it: the heading, a table of the rows best first (configuration,
    sharded, text encoders, GB per rank, fits; the `top` best, default all, in a box that scrolls), what
    to buy when nothing fits (above the table), how many rows are left out, and the planner's notes."""
    head = "".join(f"<th>{name}</th>" for name in ("#", "configuration", "sharded", "text encoders", "GB/rank", "fits"))
    body = "".join(
        f"<tr style='color:{'#070' if row.fits else '#b00'}'><td>{i}</td><td>{html.escape(row.config)}</td>"
        f"<td>{'yes' if row.sharded else 'no'}</td><td>{row.text_encoders}</td>"
        f"<td style='text-align:right'>{row.gb_per_rank:.2f}</td><td>{'yes' if row.fits else 'no'}</td></tr>"
        for i, row in enumerate(plan.rows[:top], start=1)
    )
    table = f"<div style='max-height:320px;overflow-y:auto'><table><tr>{head}</tr>{body}</table></div>"
    parts = [f"<div><b>{html.escape(plan.heading)}</b></div>"]
    if plan.smallest:  # above the table, which may scroll
        parts.append(f"<div style='color:#b00'><b>{html.escape(plan.smallest)}</b></div>")
    parts.append(table)
    if top is not None and len(plan.rows) > top:
        parts.append(f"<div>... {len(plan.rows) - top} more of {len(plan.rows)}</div>")
    parts += [f"<div><i>note: {html.escape(note)}</i></div>" for note in plan.notes]
    return f"<div class='xdit-lab-folder-plan' style='font-size:12px'>{''.join(parts)}</div>"


__all__ = ["FolderPlan", "FolderPlanRow", "folder_plan_html", "gpu_memory_bytes", "plan_folder"]
