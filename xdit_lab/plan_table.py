"""The ranked table of parallel configurations: what `xdit-lab plan` prints and the explorer's planning
mode shows. ParallelConfig.options() ranks the configurations with the cost model (config.py); this
module lays them out as rows of strings, one per configuration, with the figures that ranked them.
"""

from __future__ import annotations

from .config import DEGREES, SHORT, ParallelConfig, ranking_reasons


def _number(x: float) -> str:
    """Short, exact-looking numbers for the table: 0.5, 56, 0.333."""
    return f"{x:.3g}" if x < 1000 else f"{x:,.0f}"


def _bytes(n: float) -> str:
    """Decimal units, as network bandwidths are quoted: '18.9 MB'."""
    units = ["B", "KB", "MB", "GB", "TB"]
    i = 0
    while n >= 1000 and i < len(units) - 1:
        n, i = n / 1000, i + 1
    return f"{n:.0f} B" if i == 0 else f"{n:.1f} {units[i]}"


def plan_table(
    world_size: int,
    *,
    heads=None,
    layers=None,
    seq_len=None,
    hidden_size=None,
    batch=1,
    use_cfg=True,
    top=10,
    reasons=False,
) -> tuple[list[list[str]], list[ParallelConfig]]:
    """The ranking as rows of strings, header first (the best `top`), and every configuration that
    fits, best first (kept apart from printing: the explorer's planning mode shows the same rows,
    with `reasons`: why each one ranks above the next)."""
    configs = ParallelConfig.options(
        world_size, num_heads=heads, num_layers=layers, seq_len=seq_len, use_cfg=use_cfg, batch=batch
    )
    show_bytes = seq_len is not None and hidden_size is not None
    header = ["#", "config", *(SHORT[d] for d in DEGREES), "work/rank", "comm/rank/step (p·hs)"]
    header += ["comm bytes"] if show_bytes else []
    header += ["params/rank"] + (["why above the next"] if reasons else [])
    rows = [header]
    shown = configs[: top or None]
    why = ranking_reasons(configs, layers, batch=batch, use_cfg=use_cfg)
    for i, c in enumerate(shown, start=1):
        cost = c.cost(layers, batch=batch, use_cfg=use_cfg)
        row = [
            str(i),
            c.short(),
            *(str(getattr(c, d)) for d in DEGREES),
            _number(cost.work_fraction),
            _number(cost.comm_p_hs),
        ]
        if show_bytes:
            row.append(_bytes(cost.comm_bytes(seq_len, hidden_size)))
        row.append(f"1/{c.pipefusion}" if c.pipefusion > 1 else "1")
        rows.append(row + ([why[i - 1]] if reasons else []))
    return rows, configs


def format_plan(rows: list[list[str]]) -> str:
    """plan_table's rows aligned: names and reasons read best left-aligned, numbers right-aligned."""
    return aligned(rows, left={i for i, name in enumerate(rows[0]) if name in ("config", "why above the next")})


def aligned(rows: list[list[str]], left: set[int]) -> str:
    """Rows of strings (header first) as columns two spaces apart: the columns in `left` left-aligned,
    the others (numbers) right-aligned. The planner's tables (`xdit-lab plan`, with and without --model)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(
            cell.ljust(w) if i in left else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))
        ).rstrip()
        for row in rows
    )
