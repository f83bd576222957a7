"""Views: pure functions from rank summaries (lab/summaries.py, one per rank) to matplotlib Figures.

They use `matplotlib.figure.Figure` directly, never pyplot's global state, so they work the same
in a notebook (a Figure displays itself), in tests and under the Agg backend; save with
`fig.savefig(path)`. Every rank has one colour in every view (`rank_color`).

    draw_shards(summaries)     which rank computes which image token, per cfg/dp group and stage
    draw_memory(summaries)     bytes per rank: each component (sharded, or in host memory), K/V buffers,
                               activations, weight gathers; the load's plan beside
    draw_comm(summaries)       bytes out per step per group: measured beside the closed form
    draw_latent(image, step)   one latent channel or an RGB image

PipeFusion's stale K/V views are in lab/stale_views.py; the accelerations' (the step cache, the
parallel decode) in lab/acceleration_views.py.
"""

from __future__ import annotations

import numpy as np
from matplotlib.colors import BoundaryNorm, ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from ..config import DEGREES, SHORT
from ..mesh import CFG, DP, PIPEFUSION, RING, SP, ULYSSES, WORLD
from ..plan import human_bytes

GROUP_ORDER = (DP, CFG, PIPEFUSION, RING, ULYSSES, SP)  # the degrees in their one order, then the token gather


DPI = 100  # every figure of the package, at least; text at 9 pt or more (tests/test_lab_views.py checks)
MAX_WIDTH_IN = 10  # a notebook's output area shows 1000 pixels unscaled: wider figures shrink their text


def new_figure(**kwargs) -> Figure:
    """A Figure in the package's one style: DPI, whatever the notebook's rcParams say, and at most
    MAX_WIDTH_IN wide (a figure whose panels grow with the ranks narrows them instead)."""
    width, height = kwargs.pop("figsize", (6.4, 4.8))
    return Figure(dpi=kwargs.pop("dpi", DPI), figsize=(min(width, MAX_WIDTH_IN), height), **kwargs)


def _legend_columns(fig: Figure, labels: list[str], pt: float = 9) -> int:
    """As many legend columns as fit the figure's width at `pt` (about 0.6 em per character)."""
    entry = max(len(label) for label in labels) * 0.6 * pt + 3 * pt  # points: text, handle and gap
    return max(1, min(len(labels), int(fig.get_figwidth() * 72 // entry)))


def legibility_problems(fig: Figure, min_pt: float = 9) -> list[str]:
    """What breaks the one style in a figure once drawn: a dpi under DPI, a width over MAX_WIDTH_IN
    (a notebook would scale it, and its text, down), text under `min_pt`, text cut off by the
    figure's edge. Empty list: legible."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer, edge = canvas.get_renderer(), fig.bbox
    problems = [f"dpi {fig.dpi:g} < {DPI}"] if fig.dpi < DPI else []
    if fig.get_figwidth() > MAX_WIDTH_IN:
        problems.append(f"{fig.get_figwidth():.1f} in wide > {MAX_WIDTH_IN} in: a notebook shows it scaled down")
    undrawn = set()  # labels of ticks outside the axis' view: kept by matplotlib, never drawn
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            low, high = sorted(axis.get_view_interval())
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                if not low - 1e-9 * (high - low) <= tick.get_loc() <= high + 1e-9 * (high - low):
                    undrawn |= {id(tick.label1), id(tick.label2)}
    for text in fig.findobj(Text):
        if not text.get_visible() or not text.get_text().strip() or id(text) in undrawn:
            continue
        if text.get_fontsize() < min_pt:
            problems.append(f"{text.get_text()!r} at {text.get_fontsize():g} pt")
        box = text.get_window_extent(renderer)
        if box.x0 < edge.x0 - 1 or box.y0 < edge.y0 - 1 or box.x1 > edge.x1 + 1 or box.y1 > edge.y1 + 1:
            problems.append(f"{text.get_text()!r} cut off by the figure's edge")
    return problems


def rank_color(rank: int, world_size: int):
    import matplotlib

    cmap = matplotlib.colormaps["tab10" if world_size <= 10 else "tab20"]
    return cmap(rank % cmap.N)


def _scale(largest: float) -> tuple[float, str]:
    """A unit for an axis whose largest value is `largest` bytes: decimal, as plan.human_bytes says them."""
    for power, unit in ((3, "GB"), (2, "MB"), (1, "KB")):
        if largest >= 1000**power:
            return 1000**power, unit
    return 1, "B"


def _by_rank(summaries) -> list[dict]:
    summaries = [s for s in summaries if s is not None]  # idle ranks report nothing
    if not summaries:
        raise ValueError("no rank summaries to draw (are all ranks idle, or has no session started?)")
    return sorted(summaries, key=lambda s: s["rank"])


def role(summary) -> str:
    """Where a rank sits in the grid, the degrees above 1 only: 'cfg 1 · ulysses 0', or 'serial'."""
    c, config = summary["coords"], summary["config"]
    used = [f"{SHORT[name]} {c[name]}" for name in DEGREES if config[name] > 1]
    return " · ".join(used) or "serial"


def notation(config: dict) -> str:
    """The activation layout in the x[B, S/sp, H, D] notation, with numbers, e.g. x[B/2, S/4, H, D]."""
    batch_split = config[CFG] * config[DP]
    sp = config[ULYSSES] * config[RING]
    batch = f"B/{batch_split}" if batch_split > 1 else "B"
    if config[PIPEFUSION] > 1:
        patches = config["num_patches"] or config[PIPEFUSION]
        seq = f"S/({patches} patches × {sp})" if sp > 1 else f"S/{patches} patches"
    else:
        seq = f"S/{sp}" if sp > 1 else "S"
    return f"x[{batch}, {seq}, H, D]"


def _explain(config: dict) -> str:
    """One line on what moves, for the shards view's title."""
    parts = []
    if config[ULYSSES] > 1:
        parts.append(f"attention on q[B, H/{config['ulysses']}, S, D] after the Ulysses all-to-all")
    if config[RING] > 1:
        parts.append(f"K/V blocks travel a ring of {config['ring']}")
    if config[PIPEFUSION] > 1:
        parts.append(f"blocks L/{config['pipefusion']} per stage, patches are row bands")
    if config[CFG] > 1 or config[DP] > 1:
        parts.append("batch rows split over cfg × dp (one panel each)")
    return "; ".join(parts) or "one rank holds everything"


def spans(numbers) -> str:
    """Distinct ints as sorted ranges, e.g. [3, 0, 1, 2, 2, 7] -> "0–3, 7" (a batch of 10 fits a title)."""
    parts, numbers = [], sorted(set(numbers))
    for n in numbers:
        if parts and n == parts[-1][1] + 1:
            parts[-1][1] = n
        else:
            parts.append([n, n])
    return ", ".join(str(a) if a == b else f"{a}–{b}" for a, b in parts) or "none"


# ---- shards ---------------------------------------------------------------------------------------------


def shard_map(group: list[dict]) -> np.ndarray:
    """rows × cols of the rank that computes each token (-1: none) for ranks sharing one image."""
    rows, cols = group[0]["grid"]
    owner = np.full(rows * cols, -1)
    for s in group:
        for start, stop in s["shard"]["tokens"]:
            owner[start:stop] = s["rank"]
    return owner.reshape(rows, cols)


def draw_shards(summaries) -> Figure:
    """The image's token grid coloured by the rank that computes each token: one panel per
    (dp, cfg, PipeFusion stage), since those ranks each cover the whole grid for their rows/blocks."""
    summaries = _by_rank(summaries)
    world = max(s["rank"] for s in summaries) + 1
    config = summaries[0]["config"]
    panels: dict[tuple, list[dict]] = {}
    for s in summaries:
        c = s["coords"]
        panels.setdefault((c[DP], c[CFG], c[PIPEFUSION]), []).append(s)
    keys = sorted(panels)
    ncols = min(len(keys), 2)  # two panels a row fit a notebook unscaled
    nrows = -(-len(keys) // ncols)
    rows, cols = summaries[0]["grid"]
    fig = new_figure(figsize=(3.4 * ncols + 0.6, 3.4 * nrows * rows / max(cols, 1) + 1.6), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    cmap = ListedColormap([rank_color(r, world) for r in range(world)]).with_extremes(bad="white")
    norm = BoundaryNorm(np.arange(-0.5, world + 0.5), world)
    for ax, key in zip(axes, keys):
        group = panels[key]
        owner = shard_map(group)
        ax.imshow(np.ma.masked_less(owner, 0), cmap=cmap, norm=norm, interpolation="nearest")
        if owner.size <= 400:  # small grids: the rank in every token, as JAX's sharding pictures do
            for (i, j), r in np.ndenumerate(owner):
                ax.text(j, i, "·" if r < 0 else str(r), ha="center", va="center", fontsize=9, color="white")
        ax.set_xticks([]), ax.set_yticks([])
        ax.set_xlabel(f"{cols} token columns"), ax.set_ylabel(f"{rows} token rows")
        batch = group[0]["batch"]
        branch = {0: " (uncond)", 1: " (cond)"}.get(batch["cfg_half"], "")
        title = (
            f"dp {key[0]} · cfg {key[1]}{branch}: batch rows {'?' if batch['rows'] is None else spans(batch['rows'])}"
        )
        title += " (stand-in, dropped)" if batch["stand_in"] else ""
        pf = group[0]["shard"][PIPEFUSION]
        if pf is not None:
            a, b = pf["blocks"]
            title += f"\nstage {pf['stage']}: " + (f"block {a}" if b == a + 1 else f"blocks {a}–{b - 1}")
            for p, (start, stop) in enumerate(pf["patches"]):
                top, bottom = start // cols, stop // cols
                ax.axhline(bottom - 0.5, color="black", linewidth=2)
                ax.text(cols - 0.4, (top + bottom - 1) / 2, f" patch {p}", va="center", ha="left", fontsize=9)
        ax.set_title(title, fontsize=9)
    for ax in axes[len(keys) :]:
        ax.set_visible(False)
    handles = [Patch(color=rank_color(s["rank"], world), label=f"rank {s['rank']}: {role(s)}") for s in summaries]
    columns = _legend_columns(fig, [h.get_label() for h in handles])
    fig.legend(handles=handles, loc="outside lower center", ncols=columns, fontsize=9, frameon=False)
    fig.suptitle(
        f"{notation(config)}   {summaries[0]['grid'][0]}×{summaries[0]['grid'][1]} = "
        f"{summaries[0]['image_tokens']} image tokens\n{_explain(config)}",
        fontsize=10,
    )
    return fig


# ---- staleness ----------------------------------------------------------------------------------------


# ---- memory ---------------------------------------------------------------------------------------------


def draw_memory(summaries) -> Figure:
    """What each rank holds, measured (left panel), beside the load's plan (right panel).

    Left, per rank, a stacked bar of what is on its device: each component as the rank holds it
    (rank_summary's memory["components"], counted tensor by tensor; a component FSDP2 shards is named
    with its group and marked with the share of the whole this rank holds), PipeFusion's K/V buffers,
    the activations and, with sharded weights, the gather buffer (the whole blocks a forward holds at
    once, from this rank's FSDP2 units; hatched: held only while a forward runs). A text encoder kept in
    host memory (load_pipeline(on_host=...)) is a bar of its own beside, cross-hatched: not on the
    device. A component whose linear weights are quantized (load_pipeline(quantization=...)) says its scheme. Right: the load's plan (pipe.memory_plan, from the headers before a byte was read: the
    busiest rank), term by term in the same colours; a decode in row bands names the whole decode's peak beside."""
    import matplotlib

    summaries = _by_rank(summaries)
    held = [s["memory"]["components"] for s in summaries]
    names = sorted({name for h in held for name in h})
    host = [name for name in names if any(h.get(name, {}).get("on_host") for h in held)]
    device = [name for name in names if name not in host]
    plan = summaries[0]["memory"]["plan"]

    def label(name):
        c = next(h[name] for h in held if name in h)
        stored = f" ({'/'.join(c['quantized'])} weights)" if c.get("quantized") else ""
        return f"{name} (FSDP2 shard, {c['group']} group)" if c["sharded"] else name + stored

    def component(name, key):
        return [h.get(name, {}).get(key, 0) for h in held]

    # (colour key, legend label, bytes per rank, hatch): the device's bar, then the host's
    measured = [(name, label(name), component(name, "held_bytes"), None) for name in device]
    measured.append(("kv", "K/V buffers (PipeFusion)", [s["memory"]["kv_buffer_bytes"] for s in summaries], None))
    measured.append(("activations", "activations", [s["memory"]["activation_bytes"] for s in summaries], None))
    gathers = [s["memory"]["weight_gather_bytes"] for s in summaries]
    if any(gathers):
        measured.append(("gathers", "weight gathers (during a forward)", gathers, "//"))
    on_host = [(name, f"{name} (in host memory)", component(name, "held_bytes"), "xx") for name in host]
    term = {"weight gathers": "gathers", "stale K/V": "kv"}  # the plan's activation terms by colour key
    planned = [(name, name, [plan["per_rank_bytes"].get(name, 0)], None) for name in device]
    whole_decode = plan.get("decode_peak_whole")

    def planned_label(name, size):  # the decode in bands says what the whole decode would hold instead
        if name == "decode peak" and whole_decode and whole_decode != size:
            return f"decode peak (planned, in bands; whole {human_bytes(whole_decode)})"
        return f"{name} (planned)"

    planned += [
        (term.get(name, name), planned_label(name, size), [size], "//" if name == "weight gathers" else None)
        for name, size in plan["activation_bytes"].items()
    ]
    planned_host = [(name, name, [plan["component_bytes"].get(name, 0)], "xx") for name in plan["on_host"]]

    keys = list(dict.fromkeys(key for key, *_ in (*measured, *on_host, *planned, *planned_host)))
    colours = matplotlib.colormaps["Set2"]
    colour = {key: colours(i % colours.N) for i, key in enumerate(keys)}
    stacks = [measured, on_host, planned, planned_host]
    totals = [np.sum([values for _, _, values, _ in stack], axis=0) if stack else np.zeros(1) for stack in stacks]
    unit, unit_name = _scale(float(max(t.max() for t in totals)))
    top = max(t.max() for t in totals) / unit * 1.15

    n = len(summaries)
    fig = new_figure(figsize=(max(5.6, 2.4 + (1.6 if host else 1.1) * n + 1.6), 5.0), layout="constrained")
    ratios = [max(n, 2) * (1.5 if host else 1.0), 1.6 if planned_host else 1.1]
    ax, plan_ax = fig.subplots(1, 2, sharey=True, gridspec_kw=dict(width_ratios=ratios))
    x = np.arange(n)
    width = 0.4 if host else 0.6
    labels = {}  # legend: one entry per colour key, the measured label first

    def stack(axes, positions, segments, fractions=False):
        bottom = np.zeros(len(positions))
        for key, text, values, hatch in segments:
            values = np.asarray(values, dtype=float) / unit
            axes.bar(positions, values, width, bottom=bottom, color=colour[key], hatch=hatch, edgecolor="white")
            labels.setdefault(key, (text, hatch))
            if fractions and key in device:  # the share of the whole each rank holds of a sharded component
                for xi, b, v, c in zip(positions, bottom, values, (h.get(key) for h in held)):
                    if c and c["sharded"] and v >= 0.05 * top:
                        axes.text(xi, b + v / 2, f"{c['fraction']:.0%}", ha="center", va="center", fontsize=9)
            bottom += values
        return bottom

    device_x = x - 0.21 if host else x
    for xi, total in zip(device_x, stack(ax, device_x, measured, fractions=True)):
        ax.text(xi, total, human_bytes(total * unit), ha="center", va="bottom", fontsize=9)
    if host:
        for xi, total in zip(x + 0.21, stack(ax, x + 0.21, on_host)):
            ax.text(xi, total, f"host\n{human_bytes(total * unit)}", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(x, [f"rank {s['rank']}\n{role(s)}" for s in summaries], fontsize=9)
    ax.set_xlim(-0.6, n - 0.4)
    ax.set_ylabel(unit_name)
    ax.set_ylim(0, top)
    ax.set_title(
        f"Held per rank ({summaries[0]['device']}), measured\nactivations: {summaries[0]['memory']['activation_source']}",
        fontsize=9,
    )
    positions = [0.0, 1.0] if planned_host else [0.0]
    for xi, segments in zip(positions, (planned, planned_host)):
        total = stack(plan_ax, [xi], segments)[0]
        where = "host" if xi else "device"
        plan_ax.text(xi, total, f"{where}\n{human_bytes(total * unit)}", ha="center", va="bottom", fontsize=9)
    plan_ax.set_xticks(positions, ["device", "host"][: len(positions)], fontsize=9)
    plan_ax.set_xlim(-0.6, positions[-1] + 0.6)
    plan_ax.set_title("planned (headers)\nbusiest rank", fontsize=9)
    handles = [
        Patch(facecolor=colour[key], hatch=hatch, edgecolor="white", label=text)
        for key, (text, hatch) in labels.items()
    ]
    columns = _legend_columns(fig, [h.get_label() for h in handles])
    fig.legend(handles=handles, fontsize=9, loc="outside lower center", ncols=columns, frameon=False)
    return fig


# ---- communication ------------------------------------------------------------------------------------


def draw_comm(summaries, step: int = -1) -> Figure:
    """Bytes out of each rank in one step (default: the last), per group: measured (solid)
    beside the closed form of expected_bytes_per_step (hatched). A mismatch is marked '≠'."""
    summaries = _by_rank(summaries)
    world = max(s["rank"] for s in summaries) + 1
    steps = [
        (s["comm"]["measured"][step], s["comm"]["expected"][step]) if s["comm"]["measured"] else ({}, {})
        for s in summaries
    ]
    groups = [g for g in (*GROUP_ORDER, WORLD) if any(m.get(g) or e.get(g) for m, e in steps)]  # world: StepCache
    largest = max([1] + [v for m, e in steps for v in (*m.values(), *e.values())])
    unit, name = _scale(largest)
    ncols = min(len(summaries), 4)
    nrows = -(-len(summaries) // ncols)
    width = max(5.0, 1.0 + (0.9 + 0.6 * max(len(groups), 1)) * ncols)
    fig = new_figure(figsize=(width, 1.2 + 2.8 * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False, sharey=True).ravel()
    x = np.arange(len(groups))
    for ax, s, (measured, expected) in zip(axes, summaries, steps):
        colour = rank_color(s["rank"], world)
        m = np.array([measured.get(g, 0) for g in groups], dtype=float)
        e = np.array([expected.get(g, 0) for g in groups], dtype=float)
        ax.bar(x - 0.2, m / unit, width=0.4, color=colour, label="measured")
        ax.bar(x + 0.2, e / unit, width=0.4, facecolor="white", edgecolor=colour, hatch="//", label="formula")
        for xi, mi, ei in zip(x, m, e):
            if mi != ei:
                ax.text(xi, max(mi, ei) / unit, "≠", ha="center", va="bottom", color="red", fontsize=12)
        ax.set_xticks(x, groups, fontsize=9)
        ax.set_title(f"rank {s['rank']}: {role(s)}", fontsize=9)
        ax.set_ylim(0, largest / unit * 1.15)
    for ax in axes[len(summaries) :]:
        ax.set_visible(False)
    axes[0].set_ylabel(f"{name} out of the rank")
    if groups:
        axes[0].legend(fontsize=9, frameon=False)
    which = summaries[0]["step"] + step if step < 0 else step  # 0-based index of the step drawn
    when = f"step {which + 1} of {summaries[0]['num_steps']}" if summaries[0]["step"] else "no step run yet"
    fig.suptitle(
        f"Bytes out of each rank per group, {when}\nmeasured (solid) beside the closed form (hatched)", fontsize=10
    )
    return fig


# ---- latents --------------------------------------------------------------------------------------------


def draw_latent(image, step: int | None = None, *, title: str | None = None) -> Figure:
    """An H×W array (one latent channel, with a colour bar) or an H×W×3 image (scaled to [0, 1])."""
    image = np.asarray(image, dtype=float)
    if image.ndim not in (2, 3) or (image.ndim == 3 and image.shape[2] != 3):
        raise ValueError(f"draw_latent takes an H×W or H×W×3 array, got shape {image.shape}")
    aspect = image.shape[0] / image.shape[1]
    fig = new_figure(figsize=(4.2, 0.8 + 3.4 * min(max(aspect, 0.4), 2.0)), layout="constrained")
    ax = fig.subplots()
    if image.ndim == 2:
        shown = ax.imshow(image, cmap="viridis", interpolation="nearest")
        fig.colorbar(shown, ax=ax, fraction=0.046 * min(aspect, 1.0), pad=0.04)
    else:
        low, high = image.min(), image.max()
        if low < 0 or high > 1:  # latents decode to any range: stretch to the displayable one
            image = (image - low) / (high - low) if high > low else np.zeros_like(image)
        ax.imshow(image, interpolation="nearest")
    ax.set_xticks([]), ax.set_yticks([])
    heading = [t for t in (f"step {step}" if step is not None else None, title) if t]
    ax.set_title(" · ".join(heading) or f"{image.shape[0]}×{image.shape[1]}", fontsize=10)
    return fig
