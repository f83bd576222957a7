"""When each sequence-parallel split wins: bytes at a realistic size on assumed links (tutorial 04).

The bytes come from the closed forms (`expected_bytes_per_step`, which the tests check against
measured traffic); the link speeds are assumptions the caller states. Nothing here runs a process.

    dit_shapes(tokens, hidden, ...)              the shapes of a PixArt-like DiT at a given size
    bytes_per_rank(config, shapes)               {rank: {group: bytes}} per denoising step
    collective_calls(config, shapes)             {group: calls} per step: latency is paid per call
    comm_seconds(config, bytes, ranks_per_node=, fast_bytes_per_s=, slow_bytes_per_s=, latency_s=, calls=)
    compute_seconds(config, shapes, flops_per_s) the rank's share of the forward at an assumed rate
    link_rows(configs, shapes, scenarios), link_table(rows), draw_link_times(rows)

With a compute rate, a row also says what a step costs: compute + communication when nothing
overlaps; less the part of Ring's hops that hides behind the attention (a hop is posted before a
block's attention and waited after it, so only attention time can hide it; our all-to-alls and
gathers block); and max(compute, communication), the bound if everything could hide.
"""

from __future__ import annotations

import math

from matplotlib.figure import Figure

from ..lab.table import text_table
from ..lab.views import GROUP_ORDER, new_figure
from ..mesh import RING, ULYSSES
from ..plan import human_bytes


def dit_shapes(
    tokens: int = 4096,
    hidden: int = 1152,
    heads: int = 16,
    layers: int = 28,
    batch: int = 2,
    patch: int = 2,
    out_channels: int = 8,
    dtype_bytes: int = 2,
) -> dict:
    """The `shapes` expected_bytes_per_step needs, for a PixArt-like DiT (self-attention sequence
    parallel, text by cross-attention, so no joint tokens). Defaults: PixArt-α at 1024 px (a 64 × 64
    token grid, hidden 1152 = 16 heads × 72, 28 layers), one prompt with CFG (batch 2), half precision."""
    side = math.isqrt(tokens)
    rows = next(d for d in range(side, 0, -1) if tokens % d == 0)
    if hidden % heads:
        raise ValueError(f"hidden size {hidden} does not divide into {heads} heads")
    return dict(
        batch=batch,
        rows=rows,
        cols=tokens // rows,
        heads=heads,
        head_dim=hidden // heads,
        self_layers=layers,
        joint_layers=0,
        text_len=0,
        proj_width=patch * patch * out_channels,
        dtype_bytes=dtype_bytes,
    )


def bytes_per_rank(config, shapes: dict, step: int = 0) -> dict[int, dict[str, int]]:
    """expected_bytes_per_step for every rank of `config`: {rank: {group: bytes}} (no processes needed)."""
    from ..mesh import RankMesh
    from ..traffic import expected_bytes_per_step

    mesh = RankMesh(config, rank=0, world_size=config.world_size)  # coordinates only: no groups are made
    return {
        rank: expected_bytes_per_step(config, shapes, coords=mesh.coords_of(rank), step=step)
        for rank in range(config.world_size)
    }


def collective_calls(config, shapes: dict) -> dict[str, int]:
    """Calls one rank makes per step in each group: per attention layer, Ulysses one all-to-all for
    q, k and v together and one for the output, Ring one K/V hop per ring step; any other group one
    call per step (the prediction's gathers)."""
    layers = shapes["self_layers"] + shapes["joint_layers"]
    return {ULYSSES: 2 * layers, RING: (config.ring - 1) * layers}


def step_flops(shapes: dict, *, attention_only: bool = False) -> float:
    """FLOPs of one image branch through the attention layers of a PixArt-like DiT: per layer and
    token, 24·hs² for q, k, v, out (4·hs²) and the MLP (8·hs²), two FLOPs per multiply-add, and
    4·p·hs for the attention's two products (QKᵀ, PV); embeddings and cross-attention left out."""
    tokens, hidden = shapes["rows"] * shapes["cols"], shapes["heads"] * shapes["head_dim"]
    layers = shapes["self_layers"] + shapes["joint_layers"]
    per_token = 4 * tokens * hidden + (0 if attention_only else 24 * hidden * hidden)
    return layers * tokens * per_token


def compute_seconds(config, shapes: dict, flops_per_s: float, *, attention_only: bool = False) -> float:
    """The busiest rank's share of a step's forward (ParallelConfig.cost: the rows it carries over
    the sequence and stages it splits), at `flops_per_s` (an assumed achieved rate)."""
    branches = 2  # dit_shapes' batch counts both guidance branches
    share = config.cost(shapes["self_layers"], batch=max(1, shapes["batch"] // branches), use_cfg=True)
    return share.work_fraction * step_flops(shapes, attention_only=attention_only) / flops_per_s


def _members(mesh, rank: int, group: str) -> list[int]:
    return next(members for members in mesh.all_groups(group) if rank in members)


def comm_seconds(
    config,
    bytes_by_rank: dict,
    *,
    ranks_per_node: int,
    fast_bytes_per_s: float,
    slow_bytes_per_s: float,
    latency_s: float = 0.0,
    calls: dict | None = None,
) -> dict:
    """Communication seconds per step under a simple link model (an assumption, not a measurement):
    ranks r // ranks_per_node share a node; inside a node links run at fast_bytes_per_s, across
    nodes at slow_bytes_per_s. A collective (all-to-all, gather) spreads a rank's bytes evenly over
    its peers, the fast and slow parts in parallel: time = max(fast part / fast, slow part / slow).
    Ring passes go to the next rank in lock-step, so one slow hop sets every step's pace. Groups run
    one after another, with no overlap with compute. Each call also pays `latency_s` (calls per
    group from `calls`, e.g. collective_calls; one per step where it says nothing). Returns {"groups": {group: seconds},
    "links": {group: "fast"|"slow"|"mixed"}, "total": seconds}, each the slowest rank's."""
    from ..mesh import RankMesh

    mesh = RankMesh(config, rank=0, world_size=config.world_size)
    node = lambda rank: rank // ranks_per_node  # noqa: E731
    groups, links, totals = {}, {}, []
    for rank, per_group in bytes_by_rank.items():
        total = 0.0
        for group, sent in per_group.items():
            members = _members(mesh, rank, group)
            if group == RING:
                hops = list(zip(members, members[1:] + members[:1]))
                slow = any(node(a) != node(b) for a, b in hops)
                seconds, link = sent / (slow_bytes_per_s if slow else fast_bytes_per_s), ("slow" if slow else "fast")
            else:
                peers = [m for m in members if m != rank]
                far = sum(node(m) != node(rank) for m in peers) / max(len(peers), 1)
                seconds = max(sent * (1 - far) / fast_bytes_per_s, sent * far / slow_bytes_per_s)
                link = "slow" if far == 1 else "fast" if far == 0 else "mixed"
            seconds += latency_s * (calls or {}).get(group, 1)
            groups[group] = max(groups.get(group, 0.0), seconds)
            links[group] = link if links.get(group, link) == link else "mixed"
            total += seconds
        totals.append(total)
    return dict(groups=groups, links=links, total=max(totals, default=0.0))


def link_rows(configs, shapes: dict, scenarios: dict) -> list[dict]:
    """For each scenario {name: dict(ranks_per_node=..., fast_bytes_per_s=..., slow_bytes_per_s=...,
    latency_s=..., flops_per_s=...)} and configuration: bytes out of the busiest rank per group and
    comm_seconds; with flops_per_s, the step's compute and its three totals (module docstring)."""
    rows = []
    for scenario, links in scenarios.items():
        links = dict(links)
        flops_per_s = links.pop("flops_per_s", None)
        for config in configs:
            per_rank = bytes_per_rank(config, shapes)
            busiest = max(per_rank.values(), key=lambda groups: sum(groups.values()))
            comm = comm_seconds(config, per_rank, calls=collective_calls(config, shapes), **links)
            row = dict(scenario=scenario, config=config.short(), bytes=busiest, **comm)
            if flops_per_s:
                compute, ring = compute_seconds(config, shapes, flops_per_s), comm["groups"].get(RING, 0.0)
                attention = compute_seconds(config, shapes, flops_per_s, attention_only=True)
                row.update(
                    compute=compute,
                    no_overlap=compute + comm["total"],
                    ring_hidden=compute + comm["total"] - min(ring, attention),
                    bound=max(compute, comm["total"]),
                )
            rows.append(row)
    return rows


def link_table(rows) -> str:
    """The rows of link_rows as text: milliseconds per step per group, and the winner per scenario."""
    timed = all("compute" in row for row in rows)
    key = "ring_hidden" if timed else "total"  # with compute: the fastest step, else the least traffic
    best = {}
    for row in rows:
        if row["scenario"] not in best or row[key] < best[row["scenario"]][key]:
            best[row["scenario"]] = row
    lines = []
    for row in rows:
        parts = ", ".join(
            f"{g} {human_bytes(row['bytes'][g])} on {row['links'][g]} {row['groups'][g] * 1e3:.2f} ms"
            for g in GROUP_ORDER
            if g in row["groups"]
        )
        mark = ("  <- fastest step" if timed else "  <- least") if best[row["scenario"]] is row else ""
        steps = [f"{row[k] * 1e3:.2f}" for k in ("compute", "no_overlap", "ring_hidden", "bound")] if timed else []
        lines.append([row["scenario"], row["config"], f"{row['total'] * 1e3:.2f}", *steps, parts + mark])
    step_columns = ("compute", "sum", "ring hidden", "max") if timed else ()
    return text_table(
        ("links", "config", "comm ms", *step_columns, "per group (bytes out of the busiest rank, link, time)"),
        lines,
        "milliseconds per denoising step (assumed bandwidths" + (", latency and compute rate)" if timed else ")"),
    )


def draw_link_times(rows) -> Figure:
    """One panel per scenario: a bar per configuration, stacked by group, in milliseconds per step; with
    compute, a line at the compute and ✓ on the fastest step (else on the least traffic)."""
    scenarios = list(dict.fromkeys(row["scenario"] for row in rows))
    columns = min(2, len(scenarios))  # two panels a row: the figure fits a notebook unscaled
    lines = -(-len(scenarios) // columns)
    fig = new_figure(figsize=(0.6 + 3.4 * columns, 3.2 * lines), layout="constrained")
    axes = fig.subplots(lines, columns, squeeze=False).ravel()
    for ax in axes[len(scenarios) :]:
        ax.set_visible(False)
    import matplotlib

    colours = dict(zip(GROUP_ORDER, matplotlib.colormaps["Set2"].colors))
    for ax, scenario in zip(axes, scenarios):
        mine = [row for row in rows if row["scenario"] == scenario]
        key = "ring_hidden" if all("compute" in row for row in mine) else "total"  # ✓: as link_table's mark
        least = min(row[key] for row in mine)
        for x, row in enumerate(mine):
            bottom = 0.0
            for group in [g for g in GROUP_ORDER if g in row["groups"]]:
                ms = row["groups"][group] * 1e3
                ax.bar(
                    x,
                    ms,
                    bottom=bottom,
                    color=colours[group],
                    width=0.6,
                    label=group if group not in ax.get_legend_handles_labels()[1] else None,
                )
                bottom += ms
            ax.text(
                x,
                bottom,
                f"{bottom:.1f}" + (" ✓" if row[key] == least else ""),
                ha="center",
                va="bottom",
                fontsize=9,
            )
            if "compute" in row:  # the step's compute: communication under it can hide (Ring's hops do)
                ax.hlines(row["compute"] * 1e3, x - 0.4, x + 0.4, color="black", linewidth=1.5,
                          label="compute" if "compute" not in ax.get_legend_handles_labels()[1] else None)  # fmt: skip
        ax.set_xticks(range(len(mine)), [row["config"] for row in mine], fontsize=9)
        tallest = max(max(row["total"], row.get("compute", 0.0)) for row in mine)
        ax.set_ylim(0, tallest * 1e3 * 1.2)
        ax.set_title(scenario, fontsize=10)
        ax.legend(fontsize=9, frameon=False)
    for ax in axes[::columns]:
        ax.set_ylabel("ms per step", fontsize=9)
    return fig
