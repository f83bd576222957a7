"""When each sequence-parallel split wins: bytes at a realistic size on assumed links (tutorial 04).

The bytes come from the closed forms (`expected_bytes_per_step`, which the tests check against
measured traffic); the link speeds are assumptions the caller states. Nothing here runs a process.

    dit_shapes(tokens, hidden, ...)              the shapes of a PixArt-like DiT at a given size
    bytes_per_rank(config, shapes)               {rank: {group: bytes}} per denoising step
    comm_seconds(config, bytes, ranks_per_node=, fast_bytes_per_s=, slow_bytes_per_s=)
    link_rows(configs, shapes, scenarios), link_table(rows), draw_link_times(rows)
"""

from __future__ import annotations

import math

from matplotlib.figure import Figure

from ..lab.table import text_table
from ..lab.views import GROUP_ORDER
from ..memory import human_bytes
from ..mesh import RING


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
    from ..lab.summaries import expected_bytes_per_step
    from ..mesh import RankMesh

    mesh = RankMesh(config, rank=0, world_size=config.world_size)  # coordinates only: no groups are made
    return {
        rank: expected_bytes_per_step(config, shapes, coords=mesh.coords_of(rank), step=step)
        for rank in range(config.world_size)
    }


def _members(mesh, rank: int, group: str) -> list[int]:
    return next(members for members in mesh.all_groups(group) if rank in members)


def comm_seconds(
    config, bytes_by_rank: dict, *, ranks_per_node: int, fast_bytes_per_s: float, slow_bytes_per_s: float
) -> dict:
    """Communication seconds per step under a simple link model (an assumption, not a measurement):
    ranks r // ranks_per_node share a node; inside a node links run at fast_bytes_per_s, across
    nodes at slow_bytes_per_s. A collective (all-to-all, gather) spreads a rank's bytes evenly over
    its peers, the fast and slow parts in parallel: time = max(fast part / fast, slow part / slow).
    Ring passes go to the next rank in lock-step, so one slow hop sets every step's pace. Groups run
    one after another, with no overlap with compute. Returns {"groups": {group: seconds},
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
            groups[group] = max(groups.get(group, 0.0), seconds)
            links[group] = link if links.get(group, link) == link else "mixed"
            total += seconds
        totals.append(total)
    return dict(groups=groups, links=links, total=max(totals, default=0.0))


def link_rows(configs, shapes: dict, scenarios: dict) -> list[dict]:
    """For each scenario {name: dict(ranks_per_node=..., fast_bytes_per_s=..., slow_bytes_per_s=...)}
    and configuration: bytes out of the busiest rank per group and comm_seconds. Small dicts."""
    rows = []
    for scenario, links in scenarios.items():
        for config in configs:
            per_rank = bytes_per_rank(config, shapes)
            busiest = max(per_rank.values(), key=lambda groups: sum(groups.values()))
            rows.append(
                dict(scenario=scenario, config=config.short(), bytes=busiest, **comm_seconds(config, per_rank, **links))
            )
    return rows


def link_table(rows) -> str:
    """The rows of link_rows as text: milliseconds per step per group, and the winner per scenario."""
    best = {}
    for row in rows:
        if row["scenario"] not in best or row["total"] < best[row["scenario"]]["total"]:
            best[row["scenario"]] = row
    lines = []
    for row in rows:
        parts = ", ".join(
            f"{g} {human_bytes(row['bytes'][g])} on {row['links'][g]} {row['groups'][g] * 1e3:.2f} ms"
            for g in GROUP_ORDER
            if g in row["groups"]
        )
        mark = "  <- least" if best[row["scenario"]] is row else ""
        lines.append([row["scenario"], row["config"], f"{row['total'] * 1e3:.2f}", parts + mark])
    return text_table(
        ("links", "config", "ms/step", "per group (bytes out of the busiest rank, link, time)"),
        lines,
        "communication time per denoising step (assumed bandwidths)",
    )


def draw_link_times(rows) -> Figure:
    """One panel per scenario: a bar per configuration, stacked by group, in milliseconds per step."""
    scenarios = list(dict.fromkeys(row["scenario"] for row in rows))
    fig = Figure(figsize=(0.6 + 3.4 * len(scenarios), 3.2), layout="constrained")
    axes = fig.subplots(1, len(scenarios), squeeze=False).ravel()
    import matplotlib

    colours = dict(zip(GROUP_ORDER, matplotlib.colormaps["Set2"].colors))
    for ax, scenario in zip(axes, scenarios):
        mine = [row for row in rows if row["scenario"] == scenario]
        least = min(row["total"] for row in mine)
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
                f"{bottom:.1f}" + (" ✓" if row["total"] == least else ""),
                ha="center",
                va="bottom",
                fontsize=8,
            )
        ax.set_xticks(range(len(mine)), [row["config"] for row in mine], fontsize=8)
        ax.set_ylim(0, max(row["total"] for row in mine) * 1e3 * 1.2)
        ax.set_title(scenario, fontsize=9)
        ax.legend(fontsize=7, frameon=False)
    axes[0].set_ylabel("ms of communication per step")
    return fig
