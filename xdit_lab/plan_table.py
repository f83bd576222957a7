"""The ranked table of parallel configurations: what `xdit-lab plan` prints and the explorer's planning
mode shows. ParallelConfig.options() ranks the configurations with the cost model (config.py); this
module lays them out as rows of strings, one per configuration, with the figures that ranked them.
"""

from __future__ import annotations

import textwrap

from .config import GRID, SHORT, ParallelConfig, ranking_reasons

WIDTH = 100  # the columns a plan's text keeps to, its table and the lines around it (a terminal's, a review's)
LEGEND_NAME = 14  # the longest column name a legend aligns its meanings after


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
    comm_dtype=None,
    tensor_parallel=True,
    keep=None,
) -> tuple[list[list[str]], list[ParallelConfig]]:
    """The ranking as rows of strings, header first (the best `top`), and every configuration that
    fits, best first (kept apart from printing: the explorer's planning mode shows the same rows,
    with `reasons`: why each one ranks above the next). `comm_dtype`: float8 on sequence parallelism's
    links where a configuration can carry it (ParallelConfig.options). `tensor_parallel`: tp degrees ranked
    beside the others (those that divide `heads`), for a model whose family has a tp plan; False: tp 1 only.
    `keep`: a configuration's test of the rules the degrees alone cannot know (a loaded model's call, its tp plan),
    applied before the rows are numbered and said why, so that no row or reason names one that does not fit."""
    configs = ParallelConfig.options(
        world_size,
        num_heads=heads,
        num_layers=layers,
        seq_len=seq_len,
        use_cfg=use_cfg,
        batch=batch,
        comm_dtype=comm_dtype,
        tensor_parallel=tensor_parallel,
    )
    configs = [c for c in configs if keep is None or keep(c)]
    show_bytes = seq_len is not None and hidden_size is not None
    header = ["#", "config", *(SHORT[d] for d in GRID), "work", "comm (p·hs)"]
    header += ["comm bytes"] if show_bytes else []
    header += ["params"] + (["why above the next"] if reasons else [])
    rows = [header]
    shown = configs[: top or None]
    why = ranking_reasons(configs, layers, batch=batch, use_cfg=use_cfg, num_heads=heads)
    for i, c in enumerate(shown, start=1):
        cost = c.cost(layers, num_heads=heads, batch=batch, use_cfg=use_cfg)
        row = [
            str(i),
            c.short(),
            *(str(getattr(c, d)) for d in GRID),
            _number(cost.work_fraction),
            _number(cost.comm_p_hs),
        ]
        if show_bytes:
            row.append(_bytes(cost.comm_bytes(seq_len, hidden_size)))
        shares = round(1 / cost.params_fraction)  # a rank holds 1/(pf·tp) of the weights
        row.append(f"1/{shares}" if shares > 1 else "1")
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


def wrapped(text: str, width: int = WIDTH, indent: str = "  ") -> str:
    """One paragraph in lines of at most `width` characters, the ones after the first indented."""
    return textwrap.fill(text, width, subsequent_indent=indent, break_on_hyphens=False)


def legend(entries: list[tuple[str, str]], width: int = WIDTH) -> str:
    """What each column of a table means: a line (or lines, wrapped at `width`) per (column, meaning), the
    meanings aligned after the names (a name longer than `LEGEND_NAME` pushes its own first line on)."""
    indent = 2 + min(max(len(name) for name, _ in entries), LEGEND_NAME) + 2
    return "\n".join(
        textwrap.fill(
            meaning,
            width,
            initial_indent=f"  {name}  ".ljust(indent),
            subsequent_indent=" " * indent,
            break_on_hyphens=False,
        )
        for name, meaning in entries
    )


DEGREE_MEANINGS = {  # what each degree's column counts, for the legends
    "dp": "data parallel: the prompts' rows split over this many groups",
    "cfg": "classifier-free guidance: 2 runs its two branches side by side",
    "pf": "PipeFusion: the blocks in this many pipeline stages, the image in patches",
    "ring": "Ring attention: the tokens split this many ways, their K/V passed around a ring",
    "ulysses": "Ulysses: the tokens split this many ways, all-to-alls swap them for heads",
    "tp": "tensor parallelism: each linear layer split this many ways by heads and width, its outputs "
    "all-reduced twice a block (only where the family has a tp plan and tp divides the heads)",
}


def plan_legend(show_bytes: bool = False) -> str:
    """What each column of plan_table's rows means, wrapped to WIDTH: `xdit-lab plan` prints it under them."""
    entries = [
        (
            "#",
            "the rank, best first: least work, then least comm, then fewest params, then simplest; --why says "
            "which decided each row",
        ),
        ("config", "the degrees above 1, joined by · (cfg2·pf2: cfg 2 × pf 2 = 4 ranks)"),
        *((SHORT[d], DEGREE_MEANINGS[SHORT[d]]) for d in GRID),
        ("work", "single-image transformer forwards per rank per step (lower is faster)"),
        ("comm (p·hs)", "elements one rank sends per step, in units of p·hs (p tokens per image, hs hidden size)"),
    ]
    if show_bytes:
        entries.append(("comm bytes", "the same in bytes, at 2 bytes per element (bf16); MB = 10^6 bytes"))
    entries.append(("params", "the share of the model's weights each rank holds (1/pf of the blocks, 1/tp of each)"))
    return "Columns:\n" + legend(entries) + "\nCost model: see the docstring of xdit_lab.config (ParallelConfig)."


def why_lines(names: list[str], reasons: list[str]) -> str:
    """Why each row ranks above the next, a line per row (wrapped to WIDTH), from `names` ('#1 cfg2·pf2')
    and their reasons (config.ranking_reasons, plan.fit_ranking_reasons; an empty one, the last's, left out)."""
    lines = [wrapped(f"  {name}: {reason}", indent="      ") for name, reason in zip(names, reasons) if reason]
    return "\n".join(["Why each row ranks above the next (--why):", *lines])
