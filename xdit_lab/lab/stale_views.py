"""PipeFusion's stale K/V, drawn from what the buffers recorded at each read (StaleKV.reads, through
rank_summary's "staleness"): never from a rule about which patch should be fresh.

    draw_staleness(summaries)   per stage and attention layer: the oldest age at which each patch's
                                K/V slice was read in the last step
    draw_stale_reads(summaries) the whole record of one layer per stage: which patch (a row) read
                                which slice (a column) at what age: the stale-read triangle
"""

from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

from .views import _by_rank, new_figure


def _stages(summaries) -> dict:
    """Each stage's staleness record (every rank of a stage has the same ages; only its heads or
    ring part differ)."""
    stages = {}
    for s in summaries:
        if s["staleness"] is not None and s["staleness"]["layers"]:
            stages.setdefault(s["staleness"]["stage"], s["staleness"])
    return stages


def _no_pipefusion(fig: Figure, summaries) -> Figure:
    ax = fig.subplots()
    ax.axis("off")
    why = (
        "no PipeFusion in this configuration: every attention reads fresh K/V"
        if summaries[0]["staleness"] is None
        else "no PipeFusion step has run yet"
    )
    ax.text(0.5, 0.5, why, ha="center", va="center", wrap=True)
    return fig


def _annotate(ax, ages: np.ndarray, top: float) -> None:
    for (i, j), age in np.ndenumerate(ages):
        colour = "white" if age > top / 2 else "black"
        ax.text(j, i, "–" if np.isnan(age) else f"{age:.0f}", ha="center", va="center", fontsize=9, color=colour)


def draw_staleness(summaries) -> Figure:
    """Rows: (stage, attention layer); columns: patches; colour: age in steps of the patch's K/V
    when the last step read it (the oldest any patch saw; 0 = fresh), as the buffers recorded at
    each read (StaleKV.reads, through rank_summary)."""
    summaries = _by_rank(summaries)
    stages = _stages(summaries)
    fig = new_figure(figsize=(6.4, 1.6 + 0.45 * sum(len(st["layers"]) for st in stages.values())), layout="constrained")
    if not stages:
        return _no_pipefusion(fig, summaries)
    labels, ages = [], []
    for stage in sorted(stages):
        info = stages[stage]
        for layer in info["layers"]:
            short = layer.replace("single_transformer_blocks.", "single block ").replace(
                "transformer_blocks.", "block "
            )
            labels.append(f"stage {stage} · {short}")
            ages.append([np.nan if a is None else a for a in info["age"][layer]])
    ages = np.array(ages, dtype=float)
    ax = fig.subplots()
    top = max(1.0, float(np.nanmax(ages)) if np.isfinite(ages).any() else 1.0)
    image = ax.imshow(ages, cmap="Reds", vmin=0, vmax=top, aspect="auto", interpolation="nearest")
    _annotate(ax, ages, top)
    ax.set_yticks(range(len(labels)), labels, fontsize=9)
    patches = next(iter(stages.values()))["patches"]
    ax.set_xticks(
        range(ages.shape[1]), [f"patch {p}\ntokens {a}–{b - 1}" for p, (a, b) in enumerate(patches)], fontsize=9
    )
    fig.colorbar(image, ax=ax, label="oldest K/V read (steps)", ticks=range(int(top) + 1))
    info = next(iter(stages.values()))
    kind = (
        "pipelined: patch p reads later patches' K/V from the step before"
        if info["pipelined"]
        else "warmup: all patches at once, every K/V fresh"
    )
    if info.get("buffer") not in (None, "StaleKV"):  # a control's deliberately wrong buffer: say so
        kind = f"buffer {info['buffer']}, ages as it recorded them"
    ax.set_title(f"Stale K/V in step {info['step'] + 1} of {summaries[0]['num_steps']}\n{kind}", fontsize=9)
    return fig


def draw_stale_reads(summaries, layer: int = 0) -> Figure:
    """One panel per stage, for its `layer`-th attention layer: row q is the attention call of patch q
    in the last step, column p the slice of patch p it read, the colour its age in steps (0: written
    this step; "–": never written, zeros). Pipelined, the slices at and before the reader are fresh and
    the ones after it a step old: the triangle is PipeFusion's whole approximation."""
    summaries = _by_rank(summaries)
    stages = _stages(summaries)
    fig = new_figure(figsize=(3.0 + 2.6 * max(len(stages), 1), 3.2), layout="constrained")
    if not stages:
        return _no_pipefusion(fig, summaries)
    axes = fig.subplots(1, len(stages), squeeze=False).ravel()
    top = 1.0
    for ax, stage in zip(axes, sorted(stages)):
        info = stages[stage]
        name = info["layers"][min(layer, len(info["layers"]) - 1)]
        ages = np.array([[np.nan if a is None else a for a in row] for row in info["read_age"][name]], dtype=float)
        top = max(top, float(np.nanmax(ages)) if np.isfinite(ages).any() else 1.0)
        image = ax.imshow(ages, cmap="Reds", vmin=0, vmax=top, interpolation="nearest")
        _annotate(ax, ages, top)
        ticks = range(ages.shape[0])
        ax.set_xticks(ticks, [str(p) for p in ticks], fontsize=9)
        ax.set_yticks(ticks, [str(q) for q in ticks], fontsize=9)
        ax.set_xlabel("slice read (patch)", fontsize=9)
        ax.set_ylabel("reading patch", fontsize=9)
        short = name.replace("single_transformer_blocks.", "single block ").replace("transformer_blocks.", "block ")
        ax.set_title(f"stage {stage} · {short}", fontsize=9)
    fig.colorbar(image, ax=list(axes), label="age of the K/V read (steps)", ticks=range(int(top) + 1))
    step = next(iter(stages.values()))["step"] + 1
    fig.suptitle(f"Who read what in step {step}: fresh on and below the diagonal when pipelined", fontsize=10)
    return fig
