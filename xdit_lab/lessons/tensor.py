"""Tensor parallelism (tutorial 07's tp part): who holds which columns and rows of a block, and what moves.

    tp_block(state, config, block)    on each engine (lab.call): tiny Flux split over tp, one block's layers as this
                                      rank holds them (which rows or columns of the whole weight, checked against
                                      it), that block's collectives from comm_log, and the forward's tp bytes beside
                                      the closed form (traffic.tp_bytes_per_forward)
    shard_table(results)              the shards of every rank, one line a layer
    collective_table(results, rank)   one rank's collectives in the block, each with its closed-form bytes
                                      (measured beside the closed form) and parameter bytes, per rank

A weight is [out_features, in_features]: "colwise" splits its output features (the rows of the weight, the columns
of the output: q, k, v, the MLP's first layer, the modulation), "rowwise" its input features (the weight's columns:
attention's output projection, the MLP's last layer), whose partial outputs an all-reduce sums.
"""

from __future__ import annotations

import torch

from ..lab.table import text_table

# a joint block's image-stream layers, one of each kind (diffusers' FluxTransformer _tp_plan, with the adapter's
# modulation); its text stream's add_*/to_add_out/ff_context are split alike. A single-stream block's proj_out is
# packed (its attention and MLP columns cut one by one), not one contiguous range, so it is not listed here
LAYERS = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "ff.net.0.proj",
    "ff.net.2",
    "norm1.linear",
)


def _held_range(whole: torch.Tensor, held: torch.Tensor, style: str, rank: int, tp: int) -> dict:
    """Which rows (colwise: output features) or columns (rowwise: input features) of `whole` this rank holds, and
    whether they are exactly the slice [rank·n/tp, (rank+1)·n/tp) of the whole weight."""
    dim = 1 if style == "rowwise" else 0
    n = whole.shape[dim]
    start, stop = rank * n // tp, (rank + 1) * n // tp
    return dict(
        dim="in (columns)" if dim else "out (rows)",
        start=start,
        stop=stop,
        of=n,
        exact=bool(torch.equal(held, whole.narrow(dim, start, stop - start))),
    )


def tp_block(state, config, block: str = "transformer_blocks.0", batch: int = 2, text_len: int = 8) -> dict | None:
    """Tiny Flux (seed 0, the same weights on every rank) split over `config`'s tp group; one forward under
    comm_log. Returns this rank's shard of each of `block`'s LAYERS, the collectives tagged with `block`'s layers,
    and the forward's recorded tp bytes beside traffic.tp_bytes_per_forward (tokens read from the inputs)."""
    from .. import comm
    from ..mesh import TP
    from ..models import parallel_state, parallelize
    from ..models.tensor_parallel import module_tokens, tp_shapes
    from ..tiny import tiny_inputs, tiny_transformer
    from ..traffic import tp_bytes_per_forward
    from .sequence import _device, _mesh

    mesh = _mesh(config)
    if not mesh.active:
        return None
    device = _device()
    model = tiny_transformer("flux", seed=0).to(device)
    inputs = {
        k: v.to(device) if torch.is_tensor(v) else v for k, v in tiny_inputs("flux", batch, text_len=text_len).items()
    }
    whole = {name: model.get_submodule(f"{block}.{name}").weight.detach().clone() for name in LAYERS}
    model = parallelize(model, config, mesh)
    with torch.no_grad(), comm.comm_log() as log:
        model(**inputs)
    tensor = parallel_state(model).tensor
    tp, rank = mesh.group_size(TP), mesh.group_rank(TP)

    shards = []
    for name in LAYERS:
        weight = model.get_submodule(f"{block}.{name}").weight
        held = weight.to_local() if hasattr(weight, "to_local") else weight
        style = tensor.styles[f"{block}.{name}"]
        shards.append(
            dict(layer=name, style=style, whole=list(whole[name].shape), held=list(held.shape))
            | _held_range(whole[name], held.detach(), style, rank, tp)
        )

    # the closed form, record by record: a rowwise output [b, tokens, width], a gathered modulation [b, width]
    tokens = dict(image=inputs["hidden_states"].shape[1], text=inputs["encoder_hidden_states"].shape[1])
    tokens["joint"] = tokens["image"] + tokens["text"]
    e = next(model.parameters()).element_size()
    shapes = tp_shapes(model, tensor, parallel_state(model).adapter)
    rowwise = tensor.names("rowwise", "packed-rowwise")

    def expected(tag: str) -> int:
        if tag in rowwise:
            width = model.get_submodule(tag).out_features
            return tp_bytes_per_forward(tp, e, reduced=[batch * tokens[module_tokens(tag)] * width])
        return tp_bytes_per_forward(tp, e, reduced=[], gathered=[batch * model.get_submodule(tag).out_features])

    collectives = [
        dict(
            op=r.op,
            layer=r.tag[len(block) + 1 :],
            shape_elements=r.elements,
            bytes_out=r.bytes_out,
            formula=expected(r.tag),
        )
        for r in log.filter(group=TP)
        if r.tag.startswith(f"{block}.")
    ]
    forward_formula = tp_bytes_per_forward(
        tp,
        e,
        reduced=[batch * tokens[kind] * width for kind, width, *_ in shapes["rowwise"]],
        gathered=[batch * width for width, *_ in shapes["gathered"]],
    )
    return dict(
        rank=mesh.rank,
        tp_rank=rank,
        block=block,
        shards=shards,
        collectives=collectives,
        forward_tp_bytes=log.bytes_by_group().get(TP, 0),
        forward_formula=forward_formula,
        held_bytes=tensor.planned_bytes,
        whole_bytes=tensor.whole_bytes,
    )


def shard_table(results: dict) -> str:
    """Every rank's shard of each layer: its style, the whole weight's shape, the rows or columns it holds, and
    whether they equal the whole weight's slice."""
    rows = [
        [
            str(r["rank"]),
            s["layer"],
            s["style"],
            "×".join(map(str, s["whole"])),
            "×".join(map(str, s["held"])),
            f"{s['dim']} [{s['start']}, {s['stop']}) of {s['of']}",
            "yes" if s["exact"] else "NO",
        ]
        for r in _active(results)
        for s in r["shards"]
    ]
    return text_table(["rank", "layer", "style", "whole", "held", "which", "= slice"], rows)


def collective_table(results: dict, rank: int = 0) -> str:
    """One rank's tp collectives in the block, in the order they ran, with the closed form's bytes."""
    r = results[rank]
    rows = [
        [c["op"], c["layer"], f"{c['shape_elements']:,}", f"{c['bytes_out']:,}", f"{c['formula']:,}"]
        for c in r["collectives"]
    ]
    return text_table(["op", "after layer", "elements", "bytes out", "formula"], rows)


def _active(results: dict) -> list[dict]:
    return [results[k] for k in sorted(results) if results[k] is not None]
