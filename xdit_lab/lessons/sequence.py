"""Sequence-parallel lessons (tutorials 02 Ulysses, 03 Ring, 04 USP): small demos and their drawings.

Engine-side demos take the Lab's state dict first, so a notebook runs them with
`lab.call(fn, config, ...)` (tests pass `{}`); each builds a RankMesh for the configuration it is
given, runs the package's own kernels on small tensors and returns a small dict (lists, ints,
floats). Views are pure functions from those results (or rank summaries) to a matplotlib Figure.

    ulysses_exchange(state, config)   seq_to_heads / heads_to_seq on tensors whose values are (token, head)
    ring_passes(state, config)        sp_attention traced: the K/V block held at each ring step and the
                                      error of the running output after each LSE merge
    draw_ulysses_exchange(results)    tokens × heads held by each rank, before and after the all-to-all
    draw_ring_schedule(results)       rank × ring step: which K/V block each rank holds
    draw_merge_errors(results, ...)   error against full attention after each merged block
    ulysses_bytes_exercise(answer, measured, prompts)
                                      tutorial 02's exercise 2 checked against the bytes the ranks sent

When each split wins at a realistic size, on assumed links: links.py.
"""

from __future__ import annotations

import contextlib

import numpy as np
from matplotlib.colors import BoundaryNorm, ListedColormap
from matplotlib.figure import Figure

from ..lab.measure import max_relative_difference
from ..lab.views import new_figure, rank_color, spans
from ..mesh import RING, SP, ULYSSES
from .exercises import check

# ---- engine side ----------------------------------------------------------------------------------------


def _mesh(config, timeout_s: float = 60):
    from ..mesh import RankMesh

    return RankMesh(config, timeout_s=timeout_s)  # collective: every engine builds it in the same call


def _device():
    from ..distributed import current_info

    return current_info().device  # the engine's GPU under nccl, else the CPU


def _sp_layout(mesh, tokens: int):
    """Every sp rank's token count, this rank's first token, and its ring block's ulysses shards."""
    from ..sharding import shard_sizes

    u = mesh.group_size(ULYSSES)
    sizes = shard_sizes(tokens, mesh.group_size(SP))
    sp_rank, ring_rank = mesh.group_rank(SP), mesh.group_rank(RING)
    return sizes, sum(sizes[:sp_rank]), sizes[ring_rank * u : (ring_rank + 1) * u]


def _held_pairs(x) -> list[list[int]]:
    """The (token, head) pairs a [1, H, S, 2] tensor holds, read from its values."""
    return [list(pair) for pair in sorted({(int(t), int(h)) for t, h in x[0].reshape(-1, 2).tolist()})]


def ulysses_exchange(state, config, tokens: int = 8, heads: int = 4) -> dict | None:
    """seq_to_heads then heads_to_seq on x[1, heads, my tokens, 2] with x[..., 0] = token, x[..., 1] = head.

    Returns what this rank held before and after the first all-to-all (read from the received
    values, not computed), the shapes, whether the second all-to-all gave x back bit for bit,
    and the bytes that left this rank per group."""
    import torch

    from .. import comm
    from ..attention.ulysses import heads_to_seq, seq_to_heads

    mesh = _mesh(config)
    if not mesh.active:
        return None
    sizes, start, group_sizes = _sp_layout(mesh, tokens)
    mine = sizes[mesh.group_rank(SP)]
    x = torch.empty(1, heads, mine, 2)
    x[..., 0] = torch.arange(start, start + mine, dtype=torch.float32)  # token index, the same for every head
    x[..., 1] = torch.arange(heads, dtype=torch.float32).unsqueeze(-1)  # head index, the same for every token
    x = x.to(_device())  # nccl moves GPU tensors only
    with comm.comm_log() as log:
        (gathered,) = seq_to_heads([x], mesh, group_sizes, tag="demo")
        back, _ = heads_to_seq(gathered, mesh, group_sizes, heads=heads, tag="demo")
    return dict(
        rank=mesh.rank,
        coords=dict(mesh.coords),
        tokens=tokens,
        heads=heads,
        before=_held_pairs(x.cpu()),
        after=_held_pairs(gathered.cpu()),
        shape_before=list(x.shape),
        shape_after=list(gathered.shape),
        round_trip=bool(torch.equal(back, x)),
        bytes_out=log.bytes_by_group(),
        all_to_alls=len(log.filter(op="all_to_all")),
    )


@contextlib.contextmanager
def _traced_ring(record, zero_lse: bool):
    """Wrap the local kernel that ring.py calls, to see each ring step (restored after): the K/V block it
    attended, and the blocks seen so far merged (merge_stacked, as ring.py merges all of them once after the
    last): the output the ring would give had it stopped there."""
    from ..attention import ring as ring_module
    from ..attention.local import merge_stacked

    kernel = ring_module.local_attention
    parts = []

    def traced_kernel(q, k, v, *, scale=None, key_mask=None):
        out, lse = kernel(q, k, v, scale=scale, key_mask=key_mask)
        lse = lse * 0 if zero_lse else lse  # a zero LSE, as some CPU fallbacks return
        parts.append((out, lse))
        record("block", k)
        record("merged", merge_stacked(parts))
        return out, lse

    ring_module.local_attention = traced_kernel
    try:
        yield
    finally:
        ring_module.local_attention = kernel


def ring_passes(
    state, config, tokens: int = 16, heads: int = 2, head_dim: int = 8, seed: int = 0, zero_lse: bool = False
) -> dict | None:
    """sp_attention over random q, k, v [1, heads, tokens, head_dim] (the same seed on every rank;
    each rank keeps its own shard), with ring.py's kernel traced.

    Returns per ring step the K/V block this rank held (identified by comparing the received
    keys with every block of the whole K) and the relative error against full attention of the
    blocks seen so far, merged; the final output's error; bytes out per group. zero_lse=True
    replaces every block's LSE by 0, as a kernel that cannot return it would."""
    import torch

    from .. import comm
    from ..attention import local_attention, sp_attention
    from ..attention.ulysses import head_slice

    mesh = _mesh(config)
    if not mesh.active:
        return None
    device = _device()
    generator = torch.Generator().manual_seed(seed)
    q_all, k_all, v_all = (torch.randn(1, heads, tokens, head_dim, generator=generator).to(device) for _ in range(3))
    reference = local_attention(q_all, k_all, v_all)[0]
    sizes, start, _ = _sp_layout(mesh, tokens)
    u, r = mesh.group_size(ULYSSES), mesh.group_size(RING)
    mine = slice(start, start + sizes[mesh.group_rank(SP)])
    # After the Ulysses all-to-all a ring rank holds its ring block's tokens for its share of the heads.
    block_ranges = [(sum(sizes[: i * u]), sum(sizes[: (i + 1) * u])) for i in range(r)]
    my_heads = head_slice(heads, u, mesh.group_rank(ULYSSES))
    ring_rank = mesh.group_rank(RING)
    queries = slice(*block_ranges[ring_rank])
    target = reference[:, my_heads, queries]
    steps = []

    def record(kind, tensor):
        if kind == "block":
            found = [
                i
                for i, (a, b) in enumerate(block_ranges)
                if tensor.shape[2] == b - a and torch.equal(tensor, k_all[:, my_heads, a:b])
            ]
            steps.append(
                dict(
                    step=len(steps),
                    block=found[0] if found else None,
                    origin_rank=mesh.group_ranks(RING)[found[0]] if found else None,
                    tokens=list(block_ranges[found[0]]) if found else None,
                )
            )
        else:
            steps[-1]["error"] = max_relative_difference(tensor, target)

    with comm.comm_log() as log, _traced_ring(record, zero_lse):
        out = sp_attention(
            q_all[:, :, mine].contiguous(),
            k_all[:, :, mine].contiguous(),
            v_all[:, :, mine].contiguous(),
            mesh,
            seq_len=tokens,
        )
    return dict(
        rank=mesh.rank,
        coords=dict(mesh.coords),
        ring_rank=ring_rank,
        ring_size=r,
        tokens=tokens,
        queries=[mine.start, mine.stop],
        steps=steps,
        zero_lse=zero_lse,
        final_error=max_relative_difference(out, reference[:, :, mine]),
        bytes_out=log.bytes_by_group(),
        sends=len(log.filter(op="send")),
    )


# ---- exercises --------------------------------------------------------------------------------------------

ULYSSES_BYTES_HINT = (
    "the exercise's factors are the same as for the 10 prompts measured above (2,621,440 B) but one: "
    "find which, and how it changes with the prompts."
)


def ulysses_bytes_solution(prompts: int, degree: int = 2, *, folder=None, element_bytes: int = 4) -> tuple[int, str]:
    """The bytes one rank sends in the `ulysses` group per denoising step of the digits model for `prompts`
    prompts (classifier-free guidance: two rows each) under ulysses `degree`, worked out: two all-to-alls per
    self-attention layer carry four tensors (q, k and v in one, the output in the other), (N-1)/N of each
    leaving the rank. The model's sizes come from its transformer's config.json. Returns (bytes, the working)."""
    import json
    from pathlib import Path

    from ..digits.components import DIGITS_DIR

    config = json.loads((Path(folder or DIGITS_DIR) / "transformer" / "config.json").read_text())
    heads, head_dim, layers = config["num_attention_heads"], config["attention_head_dim"], config["num_layers"]
    tokens = (config["sample_size"] // config["patch_size"]) ** 2 // degree  # per rank
    rows = 2 * prompts
    value = 4 * (degree - 1) * rows * tokens * heads * head_dim * element_bytes * layers // degree
    working = (
        f"4 tensors (q, k, v in one all-to-all, the output in the other) × {degree - 1}/{degree} leaving the rank "
        f"× {rows} rows × {tokens} tokens × {heads * head_dim} ({heads} heads × {head_dim}) × {element_bytes} B "
        f"× {layers} layers = {value:,}"
    )
    return value, working


def ulysses_bytes_exercise(answer, measured: dict, prompts: int, degree: int = 2) -> str:
    """Tutorial 02's exercise 2: `answer`, the learner's bytes per rank per step, against `measured` ({rank:
    bytes} the ranks sent in the `ulysses` group). The working is said only to a right answer; before, a hint
    that leaves it to the learner. An AssertionError when the working and the measurement disagree: the lesson
    went stale, and nbval fails on it."""
    value, working = ulysses_bytes_solution(prompts, degree)
    if set(measured.values()) != {value}:
        raise AssertionError(f"the worked solution ({value:,} B) is not what the ranks sent: {measured}")
    return check(answer, measured[min(measured)], solution=working, hint=ULYSSES_BYTES_HINT)


# ---- views of the demos ---------------------------------------------------------------------------------


def _results(results) -> list[dict]:
    """lab.call's {rank: result} or a list, idle ranks (None) left out, in rank order."""
    values = results.values() if isinstance(results, dict) else results
    found = sorted((r for r in values if r is not None), key=lambda r: r["rank"])
    if not found:
        raise ValueError("no results to draw (are all ranks idle?)")
    return found


def exchange_check(results) -> dict:
    """Facts that can fail: before and after the all-to-all every (token, head) is held by exactly one
    rank of each Ulysses group's tokens; after it each rank has whole sequences for its heads;
    the way back restores every rank's shard bit for bit."""
    results = _results(results)
    tokens, heads = results[0]["tokens"], results[0]["heads"]
    every = sorted((t, h) for t in range(tokens) for h in range(heads))

    def once(key):
        held = sorted(tuple(p) for r in results for p in r[key])
        return held == every

    whole = all(len({t for t, _ in r["after"]}) * len({h for _, h in r["after"]}) == len(r["after"]) for r in results)
    return dict(
        before_once=once("before"),
        after_once=once("after"),
        after_whole_rows=whole,
        round_trip=all(r["round_trip"] for r in results),
    )


def draw_ulysses_exchange(results) -> Figure:
    """One panel per rank, before (top) and after (bottom) seq_to_heads: a heads × tokens grid,
    a cell coloured by the rank that holds that (token, head) (read from the tensor values)."""
    results = _results(results)
    world = max(r["rank"] for r in results) + 1
    tokens, heads = results[0]["tokens"], results[0]["heads"]
    columns = min(2, len(results))  # two ranks a row: the figure fits a notebook unscaled
    pairs = -(-len(results) // columns)
    fig = new_figure(figsize=(0.6 + 3.4 * columns, 4.4 * pairs), layout="constrained")
    axes = fig.subplots(2 * pairs, columns, squeeze=False)
    cmap = ListedColormap([rank_color(r, world) for r in range(world)]).with_extremes(bad="#eeeeee")
    norm = BoundaryNorm(np.arange(-0.5, world + 0.5), world)
    for empty in range(len(results), pairs * columns):  # an odd count of ranks: the last pair's second column
        pair, column = divmod(empty, columns)
        axes[2 * pair, column].set_visible(False)
        axes[2 * pair + 1, column].set_visible(False)
    for index, result in enumerate(results):
        pair, column = divmod(index, columns)
        for row, key in enumerate(("before", "after")):
            ax = axes[2 * pair + row, column]
            held = np.full((heads, tokens), -1)
            for t, h in result[key]:
                held[h, t] = result["rank"]
            ax.imshow(np.ma.masked_less(held, 0), cmap=cmap, norm=norm, interpolation="nearest", aspect="auto")
            ax.set_xticks(range(tokens), [str(t) if tokens <= 16 else "" for t in range(tokens)], fontsize=9)
            ax.set_yticks(range(heads), [str(h) for h in range(heads)], fontsize=9)
            ax.set_xticks(np.arange(-0.5, tokens), minor=True)
            ax.set_yticks(np.arange(-0.5, heads), minor=True)
            ax.grid(which="minor", color="white", linewidth=1)
            ax.tick_params(which="minor", length=0)
            shape = "×".join(map(str, result[f"shape_{key}"]))
            pairs = result[key]
            ax.set_title(
                f"rank {result['rank']} {key}: x[{shape}]\ntokens {spans([t for t, _ in pairs])}, "
                f"heads {spans([h for _, h in pairs])}",
                fontsize=9,
            )
            if column == 0:
                ax.set_ylabel("head", fontsize=9)
            if row == 1:
                ax.set_xlabel("token", fontsize=9)
    fig.suptitle("Ulysses all-to-all: sequence shards (above) become head shards (below)", fontsize=10)
    return fig


def draw_ring_schedule(results) -> Figure:
    """Rows: ranks; columns: ring steps; a cell coloured by the rank whose K/V block it holds then."""
    results = _results(results)
    world = max(r["rank"] for r in results) + 1
    steps = max(len(r["steps"]) for r in results)
    origin = np.full((len(results), steps), -1)
    for i, result in enumerate(results):
        for s in result["steps"]:
            origin[i, s["step"]] = -1 if s["origin_rank"] is None else s["origin_rank"]
    fig = new_figure(figsize=(1.6 + 1.2 * steps, 0.9 + 0.55 * len(results)), layout="constrained")
    ax = fig.subplots()
    cmap = ListedColormap([rank_color(r, world) for r in range(world)]).with_extremes(bad="#eeeeee")
    ax.imshow(
        np.ma.masked_less(origin, 0),
        cmap=cmap,
        norm=BoundaryNorm(np.arange(-0.5, world + 0.5), world),
        interpolation="nearest",
        aspect="auto",
    )
    for i, result in enumerate(results):
        for s in result["steps"]:
            text = "?" if s["block"] is None else f"K/V {s['block']}\ntokens {s['tokens'][0]}–{s['tokens'][1] - 1}"
            ax.text(s["step"], i, text, ha="center", va="center", fontsize=9, color="white")
    ax.set_xticks(range(steps), [f"step {s}" for s in range(steps)], fontsize=9)
    ax.set_yticks(range(len(results)), [f"rank {r['rank']}" for r in results], fontsize=9)
    ax.set_title(
        "Ring attention: the K/V block each rank holds at each step\n"
        "(coloured by the rank it started on; each step it moves one rank on)",
        fontsize=9,
    )
    return fig


def draw_merge_errors(results, zero_lse_results=None) -> Figure:
    """Relative error of each rank's running output against full attention after each merged K/V
    block (log scale); with zero_lse_results, the same run with every LSE replaced by 0 (dashed)."""
    results = _results(results)
    world = max(r["rank"] for r in results) + 1
    fig = new_figure(figsize=(6.4, 3.8), layout="constrained")
    ax = fig.subplots()
    runs = [(results, "-", "true LSE")]
    if zero_lse_results is not None:
        runs.append((_results(zero_lse_results), "--", "LSE = 0"))
    for run, style, label in runs:
        for result in run:
            errors = [max(s["error"], 1e-12) for s in result["steps"]]
            ax.semilogy(
                range(1, len(errors) + 1),
                errors,
                style,
                marker="o",
                color=rank_color(result["rank"], world),
                label=f"rank {result['rank']}, {label}",
            )
    ax.axhline(1e-4, color="grey", linewidth=0.8)
    ax.text(1, 1e-4, " 1e-4", va="bottom", fontsize=9, color="grey")
    steps = max(len(r["steps"]) for r in results)
    ax.set_xticks(range(1, steps + 1))
    ax.set_xlabel("K/V blocks merged")
    ax.set_ylabel("max relative error vs full attention")
    ax.legend(fontsize=9, frameon=False, ncols=2)
    ax.set_title("The running output after each LSE merge", fontsize=9)
    return fig
