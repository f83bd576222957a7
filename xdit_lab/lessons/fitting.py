"""Tutorial 14 (fitting a big model): a real model planned from its headers, then the digits model
run with its weights sharded by torch's FSDP2 on the Lab's engines, seen rank by rank.

In the notebook's own process (no engine):

    on_disk(folder)                        a header-only folder's size as its files say, and on disk
    pick(rows, short, shard, text)         one row of plan.plan_model's plan, by its configuration
    terms_table(rows)                      what one rank holds under each row, by term, in GB
    traffic_table(rows)                    bytes sent per step (activations, weight gathers) and seconds
                                           on the planner's links
    draw_terms(rows, gpu_memory)           those terms as stacked bars against one GPU's memory
    decode_bands_table(folder, height, width, frames)
                                           a Wan folder's VAE decode peak per rank, whole and in 2, 4, 8
                                           row bands (plan.wan_decode_peak_bytes, from vae/config.json)
    header_shares(folder, n)               the bytes each of n ranks holds of a component, from its
                                           safetensors headers (torch.chunk's rows on dim 0)

On the engines (`lab.call(fn, ...)`: the Lab's state dict first, small dicts back):

    held_shares(state, names)              per component the bytes this rank holds and the whole's; the
                                           rows this rank holds of the parameters `names`
    step_gathers(state)                    the next step of the Lab's session, recorded: every "weights"
                                           gather, the FSDP2 units it gathers, what is whole while each
                                           block runs; and the encode's bytes per group
    held_and_planned(state)                per component what this rank holds against pipe.memory_plan
    last_step_bytes(state)                 bytes out of this rank per group in the session's last step

Nothing here owns any math: the shards are FSDP2's, the plan is xdit_lab.plan's, the records comm.py's.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ..lab.held import component_holdings
from ..lab.table import text_table
from ..models.sharded_weights import local_parameter_bytes, whole_parameter_bytes

GB = 10**9

# ---- the plan, in the notebook's process ---------------------------------------------------------------


def on_disk(folder) -> dict:
    """The files under `folder`: their size as the files say (a header-only folder's holes count) and
    the bytes the file system really allocated for them (st_blocks: the holes take none)."""
    files = [f for f in Path(folder).rglob("*") if f.is_file()]
    return dict(
        files=len(files),
        apparent_bytes=sum(f.stat().st_size for f in files),
        allocated_bytes=sum(f.stat().st_blocks * 512 for f in files),
    )


def pick(rows, short: str, shard: bool, text_encoders: str):
    """The one row of a plan (plan.plan_model) with configuration `short` ("ulysses4"), weights sharded
    or whole, and text encoders "gpu", "sharded" or "host"."""
    found = [
        row
        for row in rows
        if row.config.short() == short and row.shard_weights == shard and row.text_encoders == text_encoders
    ]
    if len(found) != 1:
        named = sorted({row.config.short() for row in rows})
        raise ValueError(
            f"the plan has {len(found)} row(s) {short} with weights {'sharded' if shard else 'whole'} and text "
            f"encoders {text_encoders!r}; its configurations are {', '.join(named)}"
        )
    return found[0]


def label(row) -> str:
    """A row's name as the tables print it: configuration, weights (sharded, whole, or whole in a quantized
    scheme), text encoders."""
    weights = "sharded" if row.shard_weights else f"{row.quantize} whole" if row.quantize else "whole"
    if row.offload_blocks:
        weights += f" (blocks on the host, {row.offload_blocks} at a time on the GPU)"
    return f"{row.config.short()}, weights {weights}, text enc. {row.text_encoders}"


def _gb(n: int | None) -> str:
    return "?" if n is None else f"{n / GB:.2f}"


def terms_table(rows) -> str:
    """Per row (plan.FitRow), what one rank holds: each component's weights, the gather buffer, latents and
    conditioning, PipeFusion's stale K/V, the decode's peak; the total, and whether it fits; all in GB (10⁹
    bytes). A term is a column, a row a line."""
    components = list(rows[0].weights)
    header = ["row", *components, "gather", "latents+cond", "stale K/V", "decode", "total GB", "fits"]
    lines = []
    for row in rows:
        lines.append(
            [
                label(row),
                *(_gb(row.weights[name]) for name in components),
                _gb(row.gather),
                _gb(row.latents + row.conditioning),
                _gb(row.stale_kv),
                _gb(row.decode_peak),
                _gb(row.per_rank_bytes),
                "yes" if row.fits else "no",
            ]
        )
    return text_table(header, lines)


def decode_bands_table(folder, height: int, width: int, frames: int, bands=(1, 2, 4, 8)) -> str:
    """What one rank holds at the peak of the VAE decode of one video of `frames` frames at `height` × `width`, in
    bfloat16, decoded whole or in row bands (xdit_lab/vae.py): Wan's closed form (plan.wan_decode_peak_bytes) from
    the folder's vae/config.json, and each band's share of the whole decode's peak."""
    import json

    from ..families.recipe import vae_scale
    from ..plan import wan_decode_peak_bytes

    vae = json.loads((Path(folder) / "vae" / "config.json").read_text())
    spatial, temporal = vae_scale(vae)
    latent = (1, vae["z_dim"], (frames - 1) // temporal + 1, height // spatial, width // spatial)
    whole = wan_decode_peak_bytes(vae, latent, 2)
    lines = []
    for n in bands:
        peak = wan_decode_peak_bytes(vae, latent, 2, bands=n)
        lines.append([str(n), f"{-(-latent[3] // n)} of {latent[3]}", _gb(peak), f"{peak / whole:.2f}"])
    return text_table(["bands", "latent rows per rank", "decode peak GB", "of the whole decode's"], lines)


def traffic_table(rows) -> str:
    """Per row, the bytes one rank sends per denoising step (the strategy's activations, FSDP2's weight
    gathers), the text encoders' gathers once per request, and the step's traffic in seconds over
    one link at the planner's bandwidths (plan.LINKS)."""
    from ..plan import LINKS

    header = ["row", "activations GB/step", "weight gathers GB/step", "encode gathers GB"]
    header += [f"s/step {name}" for name in LINKS]
    lines = [
        [
            label(row),
            _gb(row.activation_traffic),
            _gb(row.gather_traffic),
            _gb(row.encode_gather_traffic),
            *(f"{row.seconds_per_step(bandwidth):.3f}" for bandwidth in LINKS.values()),
        ]
        for row in rows
    ]
    return text_table(header, lines)


TERM_COLOURS = {"transformer": "#4c72b0", "text encoders": "#dd8452", "vae": "#55a868", "gather buffer": "#c44e52"}


def draw_terms(rows, gpu_memory_bytes: int):
    """The rows' bytes per rank as stacked bars (transformer, text encoders, VAE, the gather buffer, the
    rest: latents, conditioning, stale K/V, decode peak) beside a line at one GPU's memory."""
    from ..lab.views import new_figure

    fig = new_figure(figsize=(8.5, 3.4), layout="constrained")
    ax = fig.subplots()
    parts = {name: [] for name in (*TERM_COLOURS, "the rest: decode, latents")}
    for row in rows:
        encoders = sum(size for name, size in row.weights.items() if name.startswith(("text_encoder", "image_encoder")))
        parts["transformer"].append(row.weights["transformer"])
        parts["text encoders"].append(encoders)
        parts["vae"].append(row.weights.get("vae", 0))
        parts["gather buffer"].append(row.gather)
        listed = row.weights["transformer"] + encoders + row.weights.get("vae", 0) + row.gather
        parts["the rest: decode, latents"].append(row.per_rank_bytes - listed)
    names = [label(row).replace(", ", "\n", 1) for row in rows]
    bottom = [0.0] * len(rows)
    for part, sizes in parts.items():
        heights = [size / GB for size in sizes]
        ax.barh(names, heights, left=bottom, color=TERM_COLOURS.get(part, "#8c8c8c"), label=part)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.axvline(
        gpu_memory_bytes / GB,
        color="black",
        linestyle="--",
        linewidth=1,
        label=f"one GPU ({gpu_memory_bytes / GB:.0f} GB)",
    )
    ax.invert_yaxis()
    ax.set_xlabel("GB held per rank (10⁹ bytes)", fontsize=9)
    ax.tick_params(labelsize=9)
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1))
    return fig


def chunk_rows(rows: int, ranks: int) -> list[int]:
    """Rows of dim 0 each of `ranks` ranks holds when FSDP2 cuts `rows` with torch.chunk: ⌈rows/N⌉ on
    the first ranks, what is left on the next, none on the last ones (6 rows on 4 ranks: 2, 2, 2, 0)."""
    chunk = -(-rows // ranks)
    return [max(0, min(chunk, rows - rank * chunk)) for rank in range(ranks)]


def header_shares(component_folder, ranks: int, dtype: torch.dtype = torch.float32) -> list[int]:
    """The bytes each of `ranks` ranks holds of a component sharded with FSDP2 (every tensor of its
    safetensors files a parameter, cut on dim 0 by torch.chunk), read from the headers alone."""
    from ..safetensors_io import read_safetensors_header

    element = torch.empty((), dtype=dtype).element_size()
    shares = [0] * ranks
    for file in sorted(Path(component_folder).glob("*.safetensors")):
        for info in read_safetensors_header(file).values():
            shape = info["shape"]
            row = math.prod(shape[1:]) * element
            for rank, rows in enumerate(chunk_rows(shape[0], ranks) if shape else [1] + [0] * (ranks - 1)):
                shares[rank] += rows * row
    return shares


# ---- on the engines ----------------------------------------------------------------------------------------


def _pipe(state):
    pipe = state.get("pipe")
    if pipe is None:
        raise RuntimeError("no pipeline is loaded on this engine: call lab.load(...) first")
    return pipe


def _modules(pipe) -> dict:
    return {name: m for name, m in pipe.diffusers_pipeline.components.items() if isinstance(m, torch.nn.Module)}


def held_shares(state: dict, names: dict[str, list[str]] | None = None) -> dict:
    """(engine) Per component: the bytes of its parameters whole and the bytes this rank holds of them
    (a sharded parameter, a DTensor, counts its local shard), how many are sharded; and for each
    component in `names` the rows this rank holds of those parameters ([first, stop) of dim 0)."""
    from ..shard_loading import rows_of_this_rank

    pipe = _pipe(state)
    out = dict(rank=state["rank"], components={}, rows={})
    if not pipe.active:
        return out
    for name, module in _modules(pipe).items():
        params = list(module.parameters())
        out["components"][name] = dict(
            whole=whole_parameter_bytes(module),
            held=local_parameter_bytes(module),
            sharded=sum(hasattr(p, "to_local") for p in params),
            parameters=len(params),
        )
    for component, wanted in (names or {}).items():
        module = _modules(pipe)[component]
        for key in wanted:
            p = module.get_parameter(key)
            first, rows = rows_of_this_rank(p, key) if hasattr(p, "to_local") else (0, p.shape[0])
            out["rows"][f"{component}: {key}"] = dict(shape=list(p.shape), rows=[first, first + rows])
    return out


def _units(module) -> list[tuple[str, torch.nn.Module, list]]:
    """(name, module, its own parameters) of every FSDP2 unit in `module`, in named_modules' order (the
    root first, named "(root)"): a unit's own parameters are those of no unit nested in it."""
    from torch.distributed.fsdp import FSDPModule

    units = [(name, m) for name, m in module.named_modules() if isinstance(m, FSDPModule)]
    out = []
    for name, m in units:
        nested = {
            id(p)
            for other, n in units
            if n is not m and (not name or other.startswith(f"{name}."))
            for p in n.parameters()
        }
        out.append((name or "(root)", m, [p for p in m.parameters() if id(p) not in nested]))
    return out


def _padded_shard_bytes(params, ranks: int) -> int:
    from ..models.sharded_weights import padded_shard_numel

    return sum(padded_shard_numel(tuple(p.shape), ranks) * p.element_size() for p in params)


def step_gathers(state: dict) -> dict:
    """(engine) Run the next step of the Lab's session inside comm_log() and return: every gather tagged
    "weights" in it (group, bytes out of this rank, in order); the other bytes out per group; the
    transformer's FSDP2 units (root first) with their padded shard bytes; while each block runs, which
    units hold their whole weights (a forward pre-hook after FSDP2's own, which gathered the block);
    the encode's bytes per group, and the text encoder's units, as the session recorded them."""
    from ..comm import comm_log

    pipe, session = _pipe(state), state.get("session")
    if session is None:
        return None
    transformer = pipe.diffusers_pipeline.transformer
    ranks = torch.distributed.get_world_size(_group_of(transformer))
    units = _units(transformer)
    whole_while = {}

    def observe(name):
        def hook(_module, _args):
            # read the parameters now: FSDP2 swaps a unit's registered parameters, sharded DTensors for
            # whole tensors, while it is gathered, and back after
            now = _units(transformer)
            whole_while[name] = [n for n, _, own in now if own and not any(hasattr(p, "to_local") for p in own)]

        return hook

    handles = [m.register_forward_pre_hook(observe(name)) for name, m, _ in units if name != "(root)"]
    try:
        with comm_log() as log:
            session.step()
    finally:
        for handle in handles:
            handle.remove()
    encoder = pipe.diffusers_pipeline.text_encoder
    encoder_ranks = torch.distributed.get_world_size(_group_of(encoder))
    other = {}
    for r in log.records:
        if r.tag != "weights":
            other[r.group] = other.get(r.group, 0) + r.bytes_out
    return dict(
        rank=state["rank"],
        gathers=[(r.group, r.bytes_out) for r in log.records if r.tag == "weights"],
        other=other,
        units=[(name, _padded_shard_bytes(own, ranks)) for name, _, own in units],
        group_size=ranks,
        whole_while=whole_while,
        encode=dict(session.comm_encode),
        encoder_units=[(name, _padded_shard_bytes(own, encoder_ranks)) for name, _, own in _units(encoder)],
        encoder_group_size=encoder_ranks,
    )


def _group_of(module):
    """The process group a module's FSDP2 shards live on (its first DTensor parameter's mesh)."""
    p = next(p for p in module.parameters() if hasattr(p, "to_local"))
    return p.device_mesh.get_group()


def held_and_planned(state: dict) -> dict:
    """(engine) Per component: the bytes this rank holds (its parameter shards, quantized weights by their
    data and scales, and persistent buffers, counted tensor by tensor) and the load's plan for it (pipe.memory_plan.per_rank_bytes); the plan's
    gather buffer term (the whole blocks and root a sharded forward holds at once) and its table."""
    pipe = _pipe(state)
    plan = pipe.memory_plan
    held = {name: holding["held_bytes"] for name, holding in component_holdings(pipe).items()}
    planned = {name: plan.per_rank_bytes[name] for name in held}
    gathers = plan.activation_bytes.get("weight gathers", (0, 0))[1]
    return dict(rank=state["rank"], held=held, planned=planned, gather_buffer=gathers, plan=plan.table())


def last_step_bytes(state: dict) -> dict | None:
    """(engine) Bytes out of this rank per group in the Lab session's last step (None on an idle rank)."""
    session = state.get("session")
    if session is None or not session.comm_per_step:
        return None
    return dict(session.comm_per_step[-1])
