"""Measurements and tables for the strategy tutorials (05 CFG/DP, 06 PipeFusion, 07 hybrid).

Pure functions over what a run already hands back (rank summaries from lab/summaries.py, latents,
the classifier's readings). Every table is
text with integers or rounded figures, so a notebook can print it in a checked cell.

    batch_table(summaries, prompts)      which rank computes which rows of the [uncond; cond] batch
    compare_to_serial(latents, serial)   max relative difference and relative L2 of the latents
    quality_row(...)                     classifier accuracy (%) and relative L2 (2 significant figures)
    draw_stale_price(rows)               those rows against warmup steps, one line per patch count (06)
    bytes_by_config(runs)                one row per (configuration, rank): bytes per group, parameters
    timing_table(session timings)        denoise seconds and ms per step, per configuration and rank
"""

from __future__ import annotations

import re

import numpy as np
from matplotlib.figure import Figure

from ..lab.measure import compare_to_serial, significant
from ..lab.table import text_table
from ..lab.views import GROUP_ORDER, new_figure, role, spans
from ..mesh import TP

# ---- accuracy against the serial run --------------------------------------------------------------


def quality_row(name: str, latents, serial_latents, read, digits) -> dict:
    """One line of an accuracy table: the share of images the classifier read as prompted (whole
    percent) and the latents' relative L2 from serial (2 significant figures, '0' when equal)."""
    read, digits = np.asarray(read, dtype=int), np.asarray(digits, dtype=int)
    if read.shape != digits.shape:
        raise ValueError(f"{read.size} readings but {digits.size} prompted digits")
    l2 = compare_to_serial(latents, serial_latents)["relative_l2"]
    return dict(
        name=name,
        accuracy_pct=int(round(100 * float((read == digits).mean()))),
        relative_l2=significant(l2) if l2 > 0 else "0",
        images=int(digits.size),
    )


def quality_table(rows: list[dict]) -> str:
    """quality_row results as aligned text."""
    return text_table(
        ["configuration", "images", "accuracy %", "rel. L2 vs serial"],
        [[r["name"], str(r["images"]), str(r["accuracy_pct"]), r["relative_l2"]] for r in rows],
    )


def draw_stale_price(rows: list[dict]) -> Figure:
    """quality_row results named "warmup W, P patches" (and "serial"), drawn as the table prints
    them: relative L2 from serial and accuracy against warmup steps, one line per patch count."""
    grid = {}
    for row in rows:
        match = re.fullmatch(r"warmup (\d+), (\d+) patches", row["name"])
        if match:
            grid[int(match[1]), int(match[2])] = row
    warmups, patch_counts = sorted({w for w, _ in grid}), sorted({p for _, p in grid})
    fig = new_figure(figsize=(7, 2.8), layout="constrained")
    l2_axis, accuracy_axis = fig.subplots(1, 2)
    for patches, marker in zip(patch_counts, "osd^v"):
        line = dict(marker=marker, label=f"{patches} patches")
        l2_axis.plot(warmups, [float(grid[w, patches]["relative_l2"]) for w in warmups], **line)
        accuracy_axis.plot(warmups, [grid[w, patches]["accuracy_pct"] for w in warmups], **line)
    serial = next((row for row in rows if row["name"] == "serial"), None)
    if serial is not None:
        accuracy_axis.axhline(serial["accuracy_pct"], color="grey", linestyle=":", label="serial")
    l2_axis.set(ylabel="rel. L2 vs serial", ylim=(0, None))
    accuracy_axis.set(ylabel="accuracy %", ylim=(0, 105))
    for axis in (l2_axis, accuracy_axis):
        axis.set_xlabel("warmup steps", fontsize=9)
        axis.yaxis.label.set_fontsize(9)
        axis.set_xticks(warmups)
        axis.tick_params(labelsize=9)
    accuracy_axis.legend(fontsize=9, loc="lower right")
    return fig


# ---- who computes which rows ------------------------------------------------------------------------


def batch_table(summaries, prompts: list[str]) -> str:
    """One line per rank: the rows of the model's batch it computes, as (branch, prompt) pairs.

    The session runs [unconditional rows; conditional rows] when guidance is on, one row per
    prompt otherwise; the rows come from the forward's own split (summary["batch"]["rows"])."""
    lines = []
    n = len(prompts)
    for s in sorted((s for s in summaries if s is not None), key=lambda s: s["rank"]):
        batch = s["batch"]
        doubled = batch["total"] == 2 * n
        parts = []
        for row in batch["rows"] or []:
            branch = ("uncond" if row < n else "cond") if doubled else "prompt"
            parts.append(f"{row}:{branch} {prompts[row % n]!r}")
        note = " (a stand-in row, computed and dropped)" if batch["stand_in"] else ""
        lines.append(
            f"rank {s['rank']} ({role(s)}): rows {spans(batch['rows'] or [])} of {batch['total']}{note}\n    "
            + "\n    ".join(parts)
        )
    return "\n".join(lines)


# ---- communication ------------------------------------------------------------------------------------


def bytes_by_config(runs: dict, step: int = -1) -> str:
    """One row per (configuration, rank): bytes out per group in one step ('measured' or
    'measured≠formula' when they disagree), and the transformer parameter bytes the rank holds.
    `runs` maps a configuration's name to its ranks' summaries (None for a rank the configuration leaves idle)."""
    rows = [
        (name, s) for name, summaries in runs.items() for s in sorted(filter(None, summaries), key=lambda s: s["rank"])
    ]
    # tp's column only where a run splits over tp: the tables of the five other degrees read as before
    groups = [g for g in GROUP_ORDER if g != TP or any(s["config"].get(TP, 1) > 1 for _, s in rows)]
    body = []
    for name, s in rows:
        measured = s["comm"]["measured"][step] if s["comm"]["measured"] else {}
        expected = s["comm"]["expected"][step] if s["comm"]["expected"] else {}
        cells = []
        for group in groups:
            m, e = measured.get(group, 0), expected.get(group, 0)
            cells.append("-" if not (m or e) else f"{m:,}" if m == e else f"{m:,}≠{e:,}")
        params = s["memory"]["parameter_bytes"].get("transformer", 0)
        body.append([name, str(s["rank"]), role(s), *cells, f"{sum(measured.values()):,}", f"{params:,}"])
    return text_table(["config", "rank", "role", *groups, "total B", "params B"], body)


# ---- time per rank (runs on the engines) -----------------------------------------------------------


def timing_table(timings_by_config: dict) -> str:
    """`{config name: session.timings()}` as text: denoise seconds and ms per step, per rank."""
    body = []
    for name, by_rank in timings_by_config.items():
        for rank in sorted(by_rank):
            t = by_rank[rank]
            if t is not None:
                per_step = t["denoise"] / max(len(t["steps"]), 1)
                body.append([name, str(rank), f"{t['denoise']:.2f}", f"{1000 * per_step:.1f}"])
    return text_table(["config", "rank", "denoise s", "ms/step"], body)
