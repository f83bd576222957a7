"""The plan as the command prints it: the ranked rows as an aligned table (format_rows; `wide`: every term of a
rank's total, a column each), what each column means (model_legend) and why each row ranks above the next
(fit_ranking_reasons)."""

from __future__ import annotations

from ..plan_table import aligned, legend
from ..quantization import TRANSFORMERS
from .rows import GB, LINKS, FitRow, fit_rank_key


def gigabytes(n: float | None) -> str:
    return "?" if n is None else f"{n / GB:.2f}"


def format_rows(rows: list[FitRow], top: int = 10, wide: bool = False) -> str:
    """The ranked rows as an aligned table, GB (10⁹ bytes) per rank: what decides a row (its placement,
    its total, whether it fits, its work and traffic), within 100 columns; `wide` adds every term of the
    total, a column each (each component's weights, the gather buffer, latents and conditioning, stale
    K/V, the decode's peak). model_legend says what each column means."""
    shown = rows[: top or None]
    table = [table_header(shown, wide)]
    for i, row in enumerate(shown, start=1):
        terms = [
            *(gigabytes(row.weights[name]) for name in row.weights),
            gigabytes(row.gather),
            gigabytes(row.latents + row.conditioning),
            gigabytes(row.stale_kv),
            gigabytes(row.decode_peak),
        ]
        table.append(
            [
                str(i),
                row.config.short(),
                weights_word(row),
                row.text_encoders,
                gigabytes(row.per_rank_bytes),
                "yes" if row.fits else "no",
                *(terms if wide else []),
                f"{row.cost.work_fraction:.3g}",
                gigabytes(row.traffic_per_step),
                *(f"{row.seconds_per_step(bandwidth):.3f}" for bandwidth in LINKS.values()),
                *([gigabytes(row.offload_traffic)] if offloaded(shown) else []),
            ]
        )
    return aligned(table, left={1, 2, 3})  # config, weights, text encoders


def weights_word(row: FitRow) -> str:
    """The weights column: whole, sharded, or offloaded with the blocks on the GPU at once (host/N)."""
    return f"host/{row.offload_blocks}" if row.offload_blocks else "sharded" if row.shard_weights else "whole"


def offloaded(rows: list[FitRow]) -> bool:
    """Whether the rows were planned with offload_blocks (every row or none): the table says the bytes moved."""
    return any(row.offload_blocks for row in rows)


OFFLOAD_COLUMN = "GB in"  # with offload_blocks: the bytes moved from the host to the GPU per step

TERM_COLUMNS = ("gather", "latents+cond", "stale K/V", "decode")  # with --wide, after each component's weights
LINK_COLUMNS = {name: f"{name} s" for name in LINKS}  # a link's seconds per step, a column each


def table_header(rows: list[FitRow], wide: bool = False) -> list[str]:
    """format_rows' column names: the terms of GB/rank (each component's weights, then TERM_COLUMNS) only
    when `wide`."""
    terms = [*(rows[0].weights if rows else ()), *TERM_COLUMNS] if wide else []
    moved = [OFFLOAD_COLUMN] if offloaded(rows) else []
    return [
        "#", "config", "weights", "text enc", "GB/rank", "fits", *terms, "work", "GB sent", *LINK_COLUMNS.values(),
        *moved,
    ]  # fmt: skip


def model_legend(rows: list[FitRow], wide: bool = False) -> str:
    """What each column of format_rows(rows, wide=wide) means, a line or a few each, within 100 columns."""
    memory = f"{rows[0].gpu_memory_bytes / GB:.3g} GB" if rows else "one GPU's memory"
    meanings = {
        "#": f"the rank, best first: fitting rows, then least work, least GB sent{' and GB in' * offloaded(rows)}, "
        "text encoders gpu before sharded before host, least GB/rank; --why says which decided each row",
        "config": "the degrees above 1, joined by · (cfg2·pf2: cfg 2 × pf 2): dp data parallel, cfg guidance's "
        "two branches side by side, pf PipeFusion stages, ring and ulysses sequence parallel",
        "weights": "the transformer's weights: whole on every rank (of its PipeFusion stage), or sharded by "
        "FSDP2 over the ranks that hold the same blocks, each block gathered whole as it runs"
        + (
            "; host/N: in host memory, N blocks at a time on the GPU with the rest of the model (offload_blocks)"
            if offloaded(rows)
            else ""
        ),
        "text enc": "the text encoders: gpu = whole on every GPU; sharded = FSDP2 over all ranks, gathered "
        "once per request; host = in host memory and run there (a slower encode; not in GB/rank)",
        "GB/rank": "what one rank's GPU holds: weights, FSDP2's gather buffer, latents, conditioning, "
        "PipeFusion's stale K/V and the decode's peak, summed" + ("" if wide else " (--wide shows each)"),
        "fits": f"yes if GB/rank is at most one GPU's memory ({memory})",
        "gather": "FSDP2's gathered copies while a sharded unit runs (the largest block's and the "
        "transformer's root; a sharded text encoder's); 0 with nothing sharded",
        "latents+cond": "the latents and the prompts' conditioning a rank keeps between steps",
        "stale K/V": "PipeFusion's stale keys and values of the busiest stage's attention layers",
        "decode": "the VAE decode's peak (split in row bands over a group's ranks); ? when the configs "
        "cannot tell (a note says why)",
        "work": "single-image transformer forwards per rank per step (lower is faster)",
        "GB sent": "what one rank sends per denoising step: the strategy's activations, plus FSDP2's "
        "weight gathers when sharded",
        OFFLOAD_COLUMN: "what crosses from host memory to one GPU per denoising step with offload_blocks: every "
        "weight of the transformer once per call (a PipeFusion stage's blocks once per patch), over PCIe "
        f"({LINKS['PCIe'] / GB:.0f} GB/s: GB in / {LINKS['PCIe'] / GB:.0f} seconds at best)",
        **{
            column: f"seconds per step to send GB sent at {name}'s {LINKS[name] / GB:.0f} GB/s (one direction, "
            "peak: xdit_lab.plan.LINKS)"
            for name, column in LINK_COLUMNS.items()
        },
    }
    for name in rows[0].weights if rows and wide else ():  # each component's weights on the rank's GPU
        meanings[name] = (
            "its weights on this rank's GPU: all, its PipeFusion stage's blocks, or an FSDP2 shard"
            if name in TRANSFORMERS
            else "its weights on this rank's GPU: all, an FSDP2 shard, or none (0.00) in host memory"
            if rows[0].request is not None and name in rows[0].request.text_encoders
            else "its weights, whole on every rank's GPU"
        )
    columns = table_header(rows, wide)
    return "Columns (GB = 10^9 bytes, per rank):\n" + legend([(name, meanings[name]) for name in columns])


WHERE = {"gpu": "whole on the GPU", "sharded": "sharded", "host": "in host memory"}  # text encoders, in words


def fit_ranking_reasons(rows: list[FitRow]) -> list[str]:
    """Why each row of a plan (plan_model's order) sits above the next, as config.ranking_reasons says it
    for `xdit-lab plan`: the first figure of fit_rank_key in which the two differ, named, with both values
    where it is one ('' for the last). A row is named by its rank in the list (#2)."""
    reasons = []
    for i, (row, below) in enumerate(zip(rows, rows[1:])):
        key, other = fit_rank_key(row), fit_rank_key(below)
        first = next((j for j, (a, b) in enumerate(zip(key, other)) if a != b), len(key))
        reasons.append(_reason(first, row, below, f"#{i + 2}"))
    return reasons + [""] * bool(rows)


def _reason(first: int, row: FitRow, below: FitRow, name: str) -> str:
    """The words for fit_rank_key's figure `first`, the first in which `row` and the next row (`below`,
    called `name`) differ."""
    if first == 0:
        return f"fits, {name} does not ({_pair(row.per_rank_bytes, below.per_rank_bytes)} GB per rank)"
    if first == 1:
        return f"less work per rank than {name} ({row.cost.work_fraction:.3g} vs {below.cost.work_fraction:.3g})"
    if first == 2:
        if row.offload_blocks:  # the weights brought from the host count as traffic too (fit_rank_key)
            moved = _pair(row.traffic_per_step + row.offload_traffic, below.traffic_per_step + below.offload_traffic)
            return f"as much work, less sent and brought from the host per step than {name} ({moved} GB)"
        sent = _pair(row.traffic_per_step, below.traffic_per_step)
        return f"as much work, less sent per step than {name} ({sent} GB)"
    if first == 3:
        return (
            f"the same work and traffic as {name}; text encoders {WHERE[row.text_encoders]} encode sooner than "
            f"{WHERE[below.text_encoders]}"
        )
    if first == 4:
        return f"the same cost as {name}, less memory per rank ({_pair(row.per_rank_bytes, below.per_rank_bytes)} GB)"
    ties = (
        "the same cost and memory as {}, fewer degrees above 1 (simpler to run)",
        "ties with {}: less dp (preferred last)",
        "ties with {}: more cfg",
        "ties with {}: more Ulysses (its all-to-alls stay on the fast links)",
        "ties with {}: more Ring",
    )
    return (*ties, "the same as {}")[min(first - 5, len(ties))].format(name)


def _pair(a: int, b: int) -> str:
    """Two byte counts in GB, 'a vs b', with the fewest decimals (at least two) that tell them apart."""
    for digits in range(2, 10):
        left, right = f"{a / GB:.{digits}f}", f"{b / GB:.{digits}f}"
        if left != right:
            break
    return f"{left} vs {right}"
