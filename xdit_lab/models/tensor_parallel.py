"""Tensor parallelism: the transformer's linear layers split over the tp group, by torch's own DTensor styles.

    parallelize(transformer, ParallelConfig(tp=2))     # each rank holds 1/2 of every planned linear layer

The plan is diffusers' own `_tp_plan` where the transformer's class declares one (Flux, Flux.2, Qwen-Image), else
the family adapter's `tp_plan`, written the same way: module-name globs -> "colwise" (the output's columns split:
q, k, v, an MLP's first layer), "rowwise" (the input's columns split, the outputs summed: attention's output
projection, an MLP's last layer), or diffusers' PackedColwiseParallel / PackedRowwiseParallel (fused layers whose
blocks are split one by one; an adapter's "packed-rowwise" is a single-stream block's output projection over
[attention; MLP], its attention block as wide as its output). Beside it, the adapter's `tp_gathered`: the AdaLN modulation linears, which
diffusers' plan leaves whole (a quarter of FLUX.1's parameters). Their output is one vector per sample
([B, 6·dim]), so each rank computes its columns and an all-gather puts them together: bytes that do not count
next to a block's activations.

Each layer is split by torch.distributed.tensor.parallel (ColwiseParallel, RowwiseParallel, parallelize_module) on
a DeviceMesh over the mesh's tp group; the weights are sliced where they lie (`src_data_rank=None`: every rank
loaded the same weights, so nothing is sent). What moves is ours: RowwiseParallel hands back its partial sums
(`output_layouts=Partial()`) and comm.all_reduce sums them over the tp group, and a gathered modulation's columns
travel through comm.all_gather, so every TP collective is recorded in the "tp" group's records like any other
(tests/test_tensor_parallel.py checks that DTensor itself sends nothing, and that the bytes are
traffic.tp_bytes_per_forward's).

Attention runs on each rank's heads: q, k and v split by columns are whole heads (tp divides the heads), which
diffusers' processors reshape by head_dim (Flux, Flux.2, Qwen-Image); a module whose processor reshapes by its head
count (Wan) is told its own (`heads`, `inner_dim` set to this rank's). A norm over one head's dims (the qk RMSNorms
of Flux) is per head and runs as it is; a norm over every head at once (Wan's `rms_norm_across_heads`, the
adapter's `tp_head_norms`) is computed exactly: its sum of squares all-reduced over the tp group.

Under PipeFusion a stage first keeps its own blocks (pipefusion/stage.py), then tp splits those: one stage's tp
ranks are neighbours on the grid, and each pipefusion group is one tp coordinate's stages (mesh.py), so the rank
of coordinate t hands its patch activations, whole after the rowwise all-reduce, to the next stage's rank of
coordinate t. Its attention runs on its own heads, so the stale K/V it keeps are theirs: 1/tp of the stage's.

    tp2·pf2    rank 0 (stage 0, tp 0) ──patch──> rank 2 (stage 1, tp 0)
               rank 1 (stage 0, tp 1) ──patch──> rank 3 (stage 1, tp 1)
               all-reduces within {0, 1} and {2, 3}

With the load options (tests/test_tp_options.py):

    compile=True          one graph: DTensor's split layers trace as they are (they send nothing), and tp's
                          all-reduces and gathers are opaque operators (xdit_lab::all_reduce, ::all_gather)
                          that run and record as in eager
    shard_weights=True    FSDP2 shards each rank's tp slices over its weights group (the ranks of one tp
                          coordinate), on a 2-D [weights, tp] DeviceMesh whose children the two share
                          (RankMesh.device_mesh); a rank holds ⌈d0/N⌉ rows of its slice's d0
    quantized weights     refused: families/tp_plan.QUANTIZED_SPLIT says why
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from .. import comm
from ..config import ParallelConfigError
from ..families.tp_plan import (
    COLWISE,
    GATHERED,
    ROWWISE,
    model_plan,
    split_parameters,
    style_name,
)
from ..mesh import TP


@dataclass
class TensorParallel:
    """What tensor parallelism did to one model on this rank: each split layer's style, by qualified name, and the
    parameter bytes this rank holds against the whole model's."""

    degree: int
    styles: dict[str, str] = field(default_factory=dict)  # name -> colwise, rowwise, packed-..., gathered
    head_norms: tuple = ()  # the norms over every head, computed exactly
    whole_bytes: int = 0  # the model's parameter bytes before the split
    planned_bytes: int = 0  # what this rank holds after it, as the plan says: 1/tp of each split layer, the rest

    def names(self, *styles: str) -> list[str]:
        return [name for name, style in self.styles.items() if style in styles]


def expand(transformer, plan: dict) -> dict[str, object]:
    """Each glob of `plan` ('transformer_blocks.*.attn.to_q': '*' a block's index) as the qualified names of the
    modules it names, in the model's order. A glob that names nothing is an error: a renamed layer would stay whole;
    but for a glob into the blocks of a PipeFusion stage, which may hold none of its layers (a stage of Flux's
    single-stream blocks alone; SD3's last block, whose text stream has no output layers), checked on the whole
    model wherever tp runs without PipeFusion."""
    patterns = [(re.compile(re.escape(glob).replace(r"\*", r"\d+")), glob, style) for glob, style in plan.items()]
    found, used = {}, set()
    for name, module in transformer.named_modules():
        for pattern, glob, style in patterns:
            if pattern.fullmatch(name):
                if not isinstance(module, torch.nn.Linear):
                    raise TypeError(f"the tp plan's {glob!r} names {name}, a {type(module).__name__}, not a Linear")
                found[name] = style
                used.add(glob)
    stage = getattr(transformer, "_xdit_lab_stage_blocks", None) is not None  # (start, stop, total) on a stage
    missing = [glob for glob in plan if glob not in used and not (stage and ".*." in glob)]
    if missing:
        raise TypeError(
            f"the tp plan of {type(transformer).__name__} names modules it does not have: {', '.join(missing)}; this "
            f"diffusers release may have renamed them"
        )
    return found


def _blocks(style, module) -> list[int]:
    """The absolute sizes of a layer's blocks along its split dim: one block, or a packed style's (diffusers' markers
    carry proportions, or leave them on the Linear as `_tp_packed_col_blocks` / `_tp_packed_row_blocks`)."""
    colwise = style_name(style) in (COLWISE, GATHERED, "packed-colwise")
    size = module.weight.shape[0 if colwise else 1]
    if style == "packed-rowwise":  # an adapter's single-stream proj_out over [attention (as wide as its output); MLP]
        return [module.out_features, size - module.out_features]
    if isinstance(style, str):
        return [size]
    blocks = style.blocks or getattr(module, "_tp_packed_col_blocks" if colwise else "_tp_packed_row_blocks", None)
    unit, rest = divmod(size, sum(blocks))
    if rest:
        raise TypeError(f"a packed layer of {size} cannot be cut in blocks {blocks}")
    return [b * unit for b in blocks]


def problems(transformer, adapter, tp: int) -> list[str]:
    """Every planned layer whose split dim (each block of a packed one) tp does not divide, and every norm over all
    heads whose width it does not divide, as sentences naming the degrees that fit."""
    found, sizes = [], set()
    planned = expand(transformer, model_plan(type(transformer), adapter))
    whole = [  # a projection beside split heads left whole (Wan 2.1 I2V's image keys): its heads would not match
        f"{attention}.{name}"
        for attention in sorted({n.rsplit(".", 1)[0] for n in planned if n.endswith(".to_q")})
        for name, module in transformer.get_submodule(attention).named_modules()
        if isinstance(module, torch.nn.Linear) and f"{attention}.{name}" not in planned
    ]
    if whole:
        return [
            f"tp {tp}: {type(transformer).__name__} has projections its tp plan does not split beside the heads it "
            f"splits ({', '.join(whole[:3])}{' and more' if len(whole) > 3 else ''}); use tp 1 for this model"
        ]
    for name, style in planned.items():
        blocks = _blocks(style, transformer.get_submodule(name))
        sizes.update(blocks)
        if any(b % tp for b in blocks):
            found.append(f"{name} ({style_name(style)}, {'+'.join(map(str, blocks))} wide)")
    for pattern in adapter.tp_head_norms:
        for name, module in transformer.named_modules():
            if re.fullmatch(pattern, name):
                sizes.add(module.weight.shape[0])
                if module.weight.shape[0] % tp:
                    found.append(f"{name} (a norm over every head, {module.weight.shape[0]} wide)")
    if not found:
        return []
    fits = [n for n in range(2, max(sizes) + 1) if all(s % n == 0 for s in sizes)][:6]
    return [
        f"tp {tp} does not divide the width of {len(found)} layer(s) of {type(transformer).__name__}: "
        f"{', '.join(found[:4])}{' and more' if len(found) > 4 else ''}; use tp in {fits or [1]}"
    ]


def planned_bytes(transformer, adapter, tp: int) -> tuple[int, int]:
    """(the model's parameter bytes, what one tp rank holds): 1/tp of each split parameter (split_parameters),
    every other parameter whole."""
    is_split = split_parameters(type(transformer), adapter)
    whole = split = 0
    for name, p in transformer.named_parameters():
        whole += p.numel() * p.element_size()
        split += p.numel() * p.element_size() if is_split(name) else 0
    return whole, whole - split + split // tp


def apply_tensor_parallel(transformer, state) -> TensorParallel:
    """Split `transformer`'s planned layers over this rank's tp group (state.mesh), in place; every hook it installs
    is one of state.hooks (named 'tp.*'). Call it before the token strategy's hooks: the layers are split before
    anything reads a shape from them."""
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    adapter, mesh = state.adapter, state.mesh
    tp = mesh.group_size(TP)
    found = problems(transformer, adapter, tp)
    if found:
        raise ParallelConfigError("; ".join(found))
    whole, planned = planned_bytes(transformer, adapter, tp)
    record = TensorParallel(tp, whole_bytes=whole, planned_bytes=planned)
    first = next(transformer.parameters())
    device_mesh = mesh.device_mesh(TP, first.device.type)
    rank = mesh.group_rank(TP)

    for name, style in expand(transformer, model_plan(type(transformer), adapter)).items():
        module = transformer.get_submodule(name)
        kind = style_name(style)
        if kind in (COLWISE, GATHERED):
            torch_style = ColwiseParallel()
        elif kind == ROWWISE:
            torch_style = RowwiseParallel(output_layouts=Partial())  # the sum is ours: comm.all_reduce below
        else:
            torch_style = _packed(kind, _blocks(style, module), rank, tp)
        torch_style.src_data_rank = None  # every rank holds the same weights: each slices its own, nothing is sent
        parallelize_module(module, device_mesh, torch_style)
        record.styles[name] = kind
        if kind in (ROWWISE, "packed-rowwise"):
            state.hooks.forward_hook(f"tp.all_reduce[{name}]", module, _all_reduce(mesh, name))
        elif kind == GATHERED:
            state.hooks.forward_hook(f"tp.all_gather[{name}]", module, _all_gather(mesh, name))
    _local_heads(transformer, record, state, tp)
    record.head_norms = _head_norms(transformer, adapter, state, tp, rank)
    return record


def _packed(kind: str, blocks: list[int], rank: int, tp: int):
    """A ColwiseParallel / RowwiseParallel whose weight is cut block by block (diffusers' packed layers: Flux's
    single-block proj_out takes [attention; MLP] columns, Flux.2's to_qkv_mlp_proj gives q, k, v and the MLP's
    two halves): this rank's slice of each block, concatenated, as the local shard."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    dim = 0 if kind == "packed-colwise" else 1

    def local(tensor: torch.Tensor) -> torch.Tensor:
        parts, offset = [], 0
        for size in blocks:
            chunk = size // tp
            parts.append(tensor.narrow(dim, offset + rank * chunk, chunk))
            offset += size
        return torch.cat(parts, dim=dim).contiguous()

    def partition(self, name, module, device_mesh):
        for param_name, param in list(module.named_parameters()):
            if dim == 1 and param_name == "bias":  # added once, after the sum: whole on every rank
                placed = DTensor.from_local(param.detach(), device_mesh, [Replicate()], run_check=False)
            else:
                placed = DTensor.from_local(local(param.detach()), device_mesh, [Shard(dim)], run_check=False)
            module.register_parameter(param_name, torch.nn.Parameter(placed, requires_grad=param.requires_grad))

    base = ColwiseParallel if dim == 0 else RowwiseParallel
    style = type(f"Packed{base.__name__}", (base,), {"_partition_linear_fn": partition})
    return style() if dim == 0 else style(output_layouts=Partial())


def _all_reduce(mesh, name: str):
    """The sum of a rowwise layer's partial outputs over the tp group, in place, recorded (comm.all_reduce)."""

    def hook(_module, _inputs, output):
        return comm.all_reduce(output, mesh, TP, tag=name)

    return hook


def _all_gather(mesh, name: str):
    """A split modulation's columns from every tp rank, in rank order: the layer's whole output, recorded."""

    def hook(_module, _inputs, output):
        return comm.all_gather(output.contiguous(), mesh, TP, dim=-1, tag=name)

    return hook


def _local_heads(transformer, record: TensorParallel, state, tp: int) -> None:
    """Every attention module whose q is split holds heads/tp heads: its `heads` and `inner_dim` say so, for the
    processors that reshape by them (Wan's by `heads`, Qwen-Image's head_dim = inner_dim / heads)."""
    for name, kind in record.styles.items():
        if not name.endswith(".to_q") or kind != COLWISE:
            continue
        attention = transformer.get_submodule(name.rsplit(".", 1)[0])
        local = {key: getattr(attention, key) // tp for key in ("heads", "inner_dim") if hasattr(attention, key)}
        if local:
            state.hooks.replace(f"tp.heads[{name}]", attention, **local)


def _head_norms(transformer, adapter, state, tp: int, rank: int) -> tuple[str, ...]:
    """The adapter's norms over every head at once (tp_head_norms: RMSNorm over heads·head_dim), computed on this
    rank's columns exactly: its weight's slice, and the sum of squares all-reduced over the tp group. Returns
    their names."""
    mesh, names = state.mesh, []
    for pattern in adapter.tp_head_norms:
        for name, module in list(transformer.named_modules()):
            if not re.fullmatch(pattern, name):
                continue
            if not isinstance(module, torch.nn.RMSNorm):
                raise TypeError(f"the adapter's tp_head_norms names {name}, a {type(module).__name__}, not an RMSNorm")
            width = module.weight.shape[0]
            weight = torch.nn.Parameter(module.weight.detach().narrow(0, rank * (width // tp), width // tp).clone())
            eps = module.eps if module.eps is not None else torch.finfo(weight.dtype).eps

            def forward(x, module=module, width=width, eps=eps, name=name):
                squares = x.float().pow(2).sum(-1, keepdim=True)
                comm.all_reduce(squares, mesh, TP, tag=name)
                return (x.float() * torch.rsqrt(squares / width + eps)).to(x.dtype) * module.weight

            state.hooks.replace(f"tp.head_norm[{name}]", module, weight=weight, forward=forward)
            names.append(name)
    return tuple(names)


def module_tokens(name: str, tokens: dict | None = None) -> str:
    """Which tokens a planned layer of a diffusers DiT runs on: what the adapter's tp_tokens says of its name, else
    by diffusers' names: 'whole_text' (a text refiner before the blocks, HunyuanVideo's token refiner: the whole
    text on every rank, which sequence shards do not cut), 'text' (a joint block's text stream: add_*, *_context,
    txt_*: the text's shard where it is cut), 'joint' (a single-stream block's [text; image]:
    single_transformer_blocks), or 'image'. Cross
    attention's output (Wan's attn2) runs on the image's queries. The closed form of tp's all-reduces
    (traffic.tp_bytes_per_forward) reads it."""
    said = [kind for pattern, kind in (tokens or {}).items() if re.fullmatch(pattern, name)]
    if said:
        return said[0]
    if name.startswith("single_transformer_blocks."):
        return "joint"
    if ".token_refiner." in name:
        return "whole_text"
    if re.search(r"(\.add_|_context\.|\.txt_|to_add_out)", name):
        return "text"
    return "image"


def after_blocks(name: str) -> bool:
    """Whether a planned layer outside the blocks runs after them, by diffusers' names of the output layers (norm_out,
    proj_out*, Z-Image's all_final_layer): only PipeFusion's last stage runs it (the others hand over after their last
    block). tests/test_tp_pipefusion.py checks it against the order every family's forward runs its layers in."""
    return re.match(r"norm_out|proj_out|all_final_layer", name) is not None


def tp_shapes(transformer, record: TensorParallel, adapter) -> dict:
    """What traffic.expected_bytes_per_step needs of a model split over tp (its `shapes["tp"]`), from the record
    apply_tensor_parallel made: each rowwise layer's [tokens it runs on (module_tokens), width, whether it runs at
    a step a StepCache skips, whether it runs after the blocks], each gathered modulation's [width, the same two],
    and the tokens each norm over every head runs on ('cross_text': a cross attention's keys) and the same. A skipped
    step runs the first block and what is outside the blocks (the output's modulation). The output layers
    (after_blocks) run on PipeFusion's last stage alone."""

    def always(name: str) -> bool:
        in_blocks = any(name.startswith(f"{blocks}.") for blocks in adapter.block_lists)
        return not in_blocks or name.startswith(f"{adapter.block_lists[0]}.0.")

    norms = []
    for name in record.head_norms:
        attention, norm = name.rsplit(".", 1)
        cross_keys = adapter.attention_kind(attention) == "cross" and norm == "norm_k"
        norms.append(["cross_text" if cross_keys else "image", always(name), after_blocks(name)])
    return dict(
        rowwise=[
            [
                module_tokens(name, adapter.tp_tokens),
                transformer.get_submodule(name).out_features,
                always(name),
                after_blocks(name),
            ]
            for name in record.names(ROWWISE, "packed-rowwise")
        ],
        gathered=[
            [transformer.get_submodule(name).out_features, always(name), after_blocks(name)]
            for name in record.names(GATHERED)
        ],
        norms=norms,
    )
