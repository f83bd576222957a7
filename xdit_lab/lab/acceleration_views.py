"""Views of the accelerations, from rank summaries (lab/summaries.py) to matplotlib Figures, in
the style of lab/views.py (one colour per rank, no pyplot state):

    draw_cache(summaries)      StepCache: the change measured per step, the steps skipped, time and bytes saved
    cache_savings(summary)     what the skipped steps saved on one rank, in seconds and bytes
    draw_decode(summaries)     the parallel VAE decode: who decodes which rows of which images, bytes per rank
"""

from __future__ import annotations

import numpy as np
from matplotlib.colors import BoundaryNorm, ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from ..mesh import CFG, DP
from ..plan import human_bytes
from .views import _by_rank, _scale, new_figure, rank_color, spans

# ---- step cache -----------------------------------------------------------------------------------------


def cache_savings(summary) -> dict:
    """What a StepCache saved on one rank: skipped steps × (mean full step - mean skipped step), in
    seconds and in bytes out of the rank (from the measured step times and comm records)."""
    skips, seconds = summary["cache"]["skips"], summary["cache"]["seconds"]
    sent = [sum(step.values()) for step in summary["comm"]["measured"]]
    run = [i for i, skipped in enumerate(skips) if not skipped]
    skipped = [i for i, s in enumerate(skips) if s]

    def saved(values):
        if not skipped:
            return 0.0
        return len(skipped) * (np.mean([values[i] for i in run]) - np.mean([values[i] for i in skipped]))

    return dict(skipped=len(skipped), steps=len(skips), seconds=float(saved(seconds)), bytes=float(saved(sent)))


def draw_cache(summaries) -> Figure:
    """A StepCache's decisions (the same on every rank): per step, the first block's change against
    the threshold, then each rank's step time and bytes out, skipped steps hatched. A diffusers cache
    (load_pipeline's cache=) is drawn the same, its change where it measures one (First-Block Cache's)."""
    summaries = _by_rank(summaries)
    if summaries[0]["cache"] is None:
        raise ValueError("this session runs without a StepCache: load with cache=StepCache(threshold)")
    first, world = summaries[0], max(s["rank"] for s in summaries) + 1
    skips, threshold = first["cache"]["skips"], first["cache"]["threshold"]
    steps = np.arange(1, len(skips) + 1)
    fig = new_figure(figsize=(8, 6.5), layout="constrained")
    change_ax, time_ax, bytes_ax = fig.subplots(3, 1, sharex=True)
    changes = [np.nan if c is None else c for c in first["cache"]["changes"]]
    change_ax.plot(steps, changes, "-", color="grey", lw=1)
    for step, change, skipped in zip(steps, changes, skips):
        change_ax.plot(step, change, "o", color="tab:green" if skipped else "tab:red")
    if threshold is not None and any(c is not None for c in first["cache"]["changes"]):
        change_ax.axhline(threshold, color="black", ls="--", lw=1, label=f"threshold {threshold:g}")
        change_ax.legend(fontsize=9, frameon=False, loc="upper right")
    change_ax.set_ylabel("first block's change", fontsize=9)
    width = 0.8 / len(summaries)
    largest = max([1] + [sum(m.values()) for s in summaries for m in s["comm"]["measured"]])
    unit, unit_name = _scale(largest)
    for k, s in enumerate(summaries):
        colour, x = rank_color(s["rank"], world), steps - 0.4 + width * (k + 0.5)
        hatch = ["//" if skipped else None for skipped in skips]
        sent = [sum(m.values()) / unit for m in s["comm"]["measured"]]
        for ax, values in ((time_ax, s["cache"]["seconds"]), (bytes_ax, sent)):
            for xi, v, h in zip(x, values, hatch):
                ax.bar(xi, v, width=width, color=colour, hatch=h, edgecolor="white" if h else colour)
    time_ax.set_ylabel("seconds", fontsize=9)
    ranks = [Patch(color=rank_color(s["rank"], world), label=f"rank {s['rank']}") for s in summaries]
    time_ax.legend(handles=ranks, fontsize=9, frameon=False, loc="upper right", ncols=min(len(ranks), 4))
    bytes_ax.set_ylabel(f"{unit_name} out", fontsize=9)
    bytes_ax.set_xlabel("step (hatched: skipped; green dot: change ≤ threshold)", fontsize=9)
    bytes_ax.set_xticks(steps)
    saved = cache_savings(first)
    fig.suptitle(
        f"{first['cache'].get('method', 'StepCache')} skipped {saved['skipped']} of {saved['steps']} steps on every rank: rank {first['rank']} saved "
        f"about {saved['seconds']:.2f} s and {human_bytes(saved['bytes'])} out",
        fontsize=10,
    )
    return fig


# ---- the VAE decode -------------------------------------------------------------------------------------

DECODE_TAGS = ("vae_halo", "vae_norm", "vae_kv", "vae_gather")


def draw_decode(summaries) -> Figure:
    """After result(): the latent's rows coloured by the rank that decodes them (halo rows, the
    ones a neighbour sends, hatched) for rank 0's images, and each rank's bytes out in the decode
    per collective, the halo's closed form hatched beside the measured halo."""
    summaries = _by_rank(summaries)
    if summaries[0]["decode"] is None:
        raise ValueError("no decode yet: call session.result() first")
    if not summaries[0]["decode"]["parallel"]:
        raise ValueError(
            "every rank decoded the whole batch (one rank per image, vae_parallel=False, or a VAE without bands: Sana's)"
        )
    world, first = max(s["rank"] for s in summaries) + 1, summaries[0]
    peers = [s for s in summaries if all(s["coords"][d] == first["coords"][d] for d in (DP, CFG))]
    rows, cols = first["decode"]["latent_shape"][-2:]
    fig = new_figure(figsize=(9, 3.8), layout="constrained")
    grid_ax, bytes_ax = fig.subplots(1, 2, width_ratios=[1, 2])
    owner = np.zeros((rows, cols))
    for s in peers:
        start, stop = s["decode"]["band"]
        owner[start:stop] = s["rank"]
    colours = [rank_color(r, world) for r in range(world)]
    grid_ax.imshow(owner, cmap=ListedColormap(colours), norm=BoundaryNorm(np.arange(world + 1) - 0.5, world))
    for s in peers[1:]:  # a boundary: one halo row on each side crosses it at every 3×3 convolution
        edge = s["decode"]["band"][0]
        for row in (edge - 1, edge):
            grid_ax.add_patch(Rectangle((-0.5, row - 0.5), cols, 1, fill=False, hatch="///", edgecolor="black", lw=0))
    grid_ax.set_title(f"latent rows of images {_images_of(first)}\n(hatched: halo rows)", fontsize=9)
    grid_ax.set_xlabel("latent columns", fontsize=9)
    grid_ax.set_ylabel("latent rows", fontsize=9)
    largest = max([1] + [n for s in summaries for n in s["decode"]["bytes"].values()])
    unit, unit_name = _scale(largest)
    width = 0.8 / len(summaries)
    x = np.arange(len(DECODE_TAGS))
    for k, s in enumerate(summaries):
        colour = rank_color(s["rank"], world)
        by_tag = {
            tag: sum(n for key, n in s["decode"]["bytes"].items() if key.endswith(":" + tag)) for tag in DECODE_TAGS
        }
        xs = x - 0.4 + width * (k + 0.5)
        bytes_ax.bar(
            xs, [by_tag[t] / unit for t in DECODE_TAGS], width=width * 0.9, color=colour, label=f"rank {s['rank']}"
        )
        bytes_ax.bar(
            xs[0], s["decode"]["halo_expected"] / unit, width=width * 0.9, fill=False, hatch="//", edgecolor="black"
        )
    bytes_ax.set_xticks(x, DECODE_TAGS, fontsize=9)
    bytes_ax.set_ylabel(f"{unit_name} out of the rank", fontsize=9)
    bytes_ax.legend(fontsize=9, frameon=False)
    shares = first["decode"]["image_shares"]
    fig.suptitle(
        f"Parallel decode: images per dp × cfg rank {shares}, each image's rows in {len(peers)} band(s); "
        f"halo closed form hatched",
        fontsize=10,
    )
    return fig


def _images_of(summary) -> str:
    decode = summary["decode"]
    first = decode["first_image"]
    return spans(range(first, first + decode["images"])) if decode["images"] else "none (a stand-in)"
