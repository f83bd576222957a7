"""The timeline of one step, per rank: when it computed, ran a collective, had transfers in flight
and waited (comm.comm_timeline, recorded by every DenoiseSession.step).

    draw_timeline(per_rank)    one row per rank; the gaps between spans are compute
    chrome_trace(per_rank)     the same spans as a Chrome trace (chrome://tracing, ui.perfetto.dev)

    rank 0 |####|......ring kv in flight......|==|###|        # collective   = wait   . in flight
    rank 1 |####|....|==|..........................|###|      (blank: compute)

Compute that a strategy names is drawn and labelled: PipeFusion's patches ("p2": patch 2 through
this stage's blocks), so a PipeFusion step is the patch × stage chart, measured:

    stage 0 |p0|p1|p2|p3|=========drain=========|
    stage 1 |==fill==|p0|p1|p2|p3|#|

Each rank's times are its own host clock from the start of its step (ranks' clocks are not
compared). A transfer is in flight from its posting to the end of the wait that completes it:
compute inside that interval is overlap. On a GPU the host clock sees launches, not kernels.
"""

from __future__ import annotations

import json
import os

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from .views import GROUP_ORDER, new_figure


def in_flight(spans: list[dict]) -> list[tuple[dict, dict]]:
    """(post, wait) pairs: each posting with the wait that completed it (comm.wait names them)."""
    posts = {s["posting"]: s for s in spans if s["kind"] == "post"}
    return [(posts[n], s) for s in spans if s["kind"] == "wait" for n in s["completes"] if n in posts]


def overlap_s(spans: list[dict]) -> float:
    """Seconds of this rank's step in which a transfer was in flight while the rank computed (no
    collective, posting or wait running): what Ring's overlap hides."""
    flying = []  # the union of the in-flight windows: several postings may be in flight at once
    for start, end in sorted((post["end_s"], wait["start_s"]) for post, wait in in_flight(spans)):
        if flying and start <= flying[-1][1]:
            flying[-1][1] = max(flying[-1][1], end)
        elif end > start:
            flying.append([start, end])
    busy = [(s["start_s"], s["end_s"]) for s in spans if s["kind"] != "compute"]
    total = 0.0
    for start, end in flying:
        covered = sum(max(0.0, min(end, b) - max(start, a)) for a, b in busy)
        total += max(0.0, end - start - covered)
    return total


def _color(group: str):
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    return cmap(GROUP_ORDER.index(group) % cmap.N) if group in GROUP_ORDER else "grey"


def draw_timeline(per_rank: dict[int, dict]) -> Figure:
    """`per_rank`: {rank: DenoiseSession.last_step_spans}. Milliseconds from each rank's step start."""
    ranks = sorted(per_rank)
    fig = new_figure(figsize=(9, 0.7 * len(ranks) + 1.6))
    ax = fig.add_subplot()
    groups, computed = set(), []
    for row, rank in enumerate(ranks):
        step = per_rank[rank]
        ms = [dict(s, start_s=s["start_s"] * 1e3, end_s=s["end_s"] * 1e3) for s in step["spans"]]
        ax.broken_barh([(0, step["seconds"] * 1e3)], (row - 0.4, 0.8), facecolor="#f2f2f2", edgecolor="#bbbbbb")
        for post, wait in in_flight(ms):
            ax.broken_barh(
                [(post["end_s"], wait["end_s"] - post["end_s"])], (row - 0.06, 0.12), color=_color(post["group"])
            )
        for span in ms:
            if span["kind"] == "compute":
                computed.append((row, span))
                continue
            groups.add(span["group"])
            width = max(span["end_s"] - span["start_s"], 1e-3)
            style = dict(color=_color(span["group"]), edgecolor="black", linewidth=0.3)
            if span["kind"] == "wait":
                style.update(hatch="///", facecolor="white", edgecolor=_color(span["group"]))
            height = 0.8 if span["kind"] != "post" else 0.5
            ax.broken_barh([(span["start_s"], width)], (row - height / 2, height), **style)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks], fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds from the step's start (each rank's own clock)", fontsize=9)
    ax.tick_params(labelsize=9)
    first = per_rank[ranks[0]]
    named = "; white: a patch's compute, grey: other" if computed else "; grey: compute"
    ax.set_title(
        f"step {first['step'] + 1}: collectives (solid), waits (hatched), transfers in flight (thin){named}",
        fontsize=10,
    )
    handles = [Patch(color=_color(g), label=g) for g in GROUP_ORDER if g in groups]
    if computed:
        handles.append(Patch(facecolor="white", edgecolor="black", label="patch p"))
    if handles:
        ax.legend(handles=handles, fontsize=9, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    _draw_computed(fig, ax, computed)
    return fig


def _draw_computed(fig: Figure, ax, computed: list[tuple[int, dict]]) -> None:
    """Named compute (PipeFusion's patches) as white boxes, labelled "p2" (or "p0-3") where the
    label fits its box at 9 pt (about 0.6 em a character) once the layout is fixed."""
    low, high = ax.get_xlim()
    px_per_ms = ax.get_position().width * fig.get_figwidth() * fig.dpi / (high - low)
    for row, span in computed:
        width = max(span["end_s"] - span["start_s"], 1e-3)
        ax.broken_barh([(span["start_s"], width)], (row - 0.3, 0.6), facecolor="white", edgecolor="black", lw=0.6)
        label = "p" + span["tag"].split(" ", 1)[1] if " " in span["tag"] else span["tag"]
        if width * px_per_ms > (0.6 * 9 * len(label) + 4) * fig.dpi / 72:
            ax.text(span["start_s"] + width / 2, row, label, ha="center", va="center", fontsize=9)


def chrome_trace(per_rank: dict[int, dict]) -> dict:
    """Trace Event Format: one thread per rank, microseconds from each rank's step start."""
    events = []
    for rank, step in sorted(per_rank.items()):
        events.append(dict(ph="M", name="thread_name", pid=0, tid=rank, args=dict(name=f"rank {rank}")))
        events.append(dict(ph="X", name=f"step {step['step'] + 1}", cat="step", pid=0, tid=rank, ts=0.0,
                           dur=step["seconds"] * 1e6))  # fmt: skip
        for span in step["spans"]:
            name = f"{span['op']} {span['group']}" + (f" {span['tag']}" if span["tag"] else "")
            events.append(
                dict(
                    ph="X",
                    name=name,
                    cat=span["kind"],
                    pid=0,
                    tid=rank,
                    ts=span["start_s"] * 1e6,
                    dur=(span["end_s"] - span["start_s"]) * 1e6,
                    args=dict(bytes_out=span["bytes_out"]),
                )
            )
    return dict(traceEvents=events, displayTimeUnit="ms")


def save_trace(per_rank: dict[int, dict], path) -> str:
    """Write chrome_trace(per_rank) to `path` whole (a neighbour, then a rename)."""
    path = os.fspath(path)
    partial = f"{path}.partial"
    with open(partial, "w") as f:
        json.dump(chrome_trace(per_rank), f)
    os.replace(partial, path)
    return path
