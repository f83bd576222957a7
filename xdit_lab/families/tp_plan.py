"""A transformer's tensor-parallel plan as data: which linear layers tp splits and how, read from diffusers'
`_tp_plan` where the class declares one and from the family adapter otherwise, and what can be told from a plan
and a checkpoint's header names and shapes alone, before a module exists: which parameters a tp rank holds a
1/tp piece of, and along which dim (the planner's weights), which layers tp does not divide, and which load options tp does not take
yet. The split itself, on modules, is models/tensor_parallel.py.

    model_plan(FluxTransformer2DModel, adapter)   # {"transformer_blocks.*.attn.to_q": "colwise", ...}
"""

from __future__ import annotations

import re

from ..config import ParallelConfigError

COLWISE, ROWWISE, GATHERED = "colwise", "rowwise", "gathered"  # GATHERED: ours, a split modulation gathered back


def model_plan(model_class, adapter) -> dict:
    """The plan of a transformer class as diffusers writes it, with the adapter's gathered modulations: diffusers'
    `_tp_plan` where the class declares one, else the adapter's `tp_plan`; refused by name where neither does."""
    plan = getattr(model_class, "_tp_plan", None) or adapter.tp_plan
    if not plan:
        why = f"{adapter.tp_refused}, so " if adapter.tp_refused else ""
        raise ParallelConfigError(
            f"tensor parallelism has no plan for {adapter.family} ({model_class.__name__}): {why}its diffusers class "
            f"declares no _tp_plan and its adapter no tp_plan; use tp 1 (ulysses, ring, cfg or dp instead), or write "
            f"the adapter's tp_plan (xdit_lab/families/{adapter.family}.py)"
        )
    return {**plan, **dict.fromkeys(adapter.tp_gathered, GATHERED)}


def has_plan(model_class, adapter) -> bool:
    """Whether tensor parallelism has a plan for this transformer class (model_plan would not refuse it)."""
    return bool(getattr(model_class, "_tp_plan", None) or adapter.tp_plan)


def option_refusals(config, *, quantization) -> list[str]:
    """What tp is not composed with yet among a load's options, as sentences (empty under tp 1): asked by
    LoadOptions.problems (so the planner lists no such row); parallelize refuses quantized weights it is handed.
    compile and shard_weights compose with tp (models/parallel.py)."""
    if config.tp == 1 or quantization is None:
        return []
    instead = f"use tp {config.tp} without it, or tp 1 ({config.replace(tp=1).short()} with it)"
    return [f"quantization {quantization!r} is not composed with tp {config.tp} yet: {QUANTIZED_SPLIT}; {instead}"]


# why tp refuses quantized weights (torchao 0.18, torch 2.13: test_tp_refuses_quantized_weights_by_name asks torchao)
QUANTIZED_SPLIT = (
    "load_pipeline quantizes each block as it reads it, before parallelize splits it, and torchao's quantized "
    "weights are not DTensor's to split: Int8Tensor implements no aten.split (the split) nor aten.view (a "
    "DTensor's local slice), Float8Tensor views only as its own shape; quantizing the split layers after "
    "parallelize is not done yet"
)


def style_name(style) -> str:
    """'colwise', 'rowwise', 'gathered', or 'packed-colwise' / 'packed-rowwise' for diffusers' packed markers."""
    from diffusers.hooks.tensor_parallel import PackedColwiseParallel

    if isinstance(style, str):
        return style
    return "packed-colwise" if isinstance(style, PackedColwiseParallel) else "packed-rowwise"


def split_parameters(model_class, adapter):
    """Whether a parameter, by its qualified name (as a checkpoint's header names it), is split over the tp ranks:
    a planned layer's weight, its bias unless rowwise (added once, after the sum: whole on every rank), a norm
    over every head's weight. From the names alone, so that a planner can read it off safetensors headers."""
    dim = split_dim(model_class, adapter)
    return lambda name: dim(name) is not None


def split_dim(model_class, adapter):
    """The dim of a parameter, by its qualified name, that tp splits (a tp rank holds 1/tp of it), or None where
    the parameter is whole on every rank: 0 for a colwise or gathered layer's weight and bias and a norm over
    every head, 1 for a rowwise layer's weight (its input columns; a packed layer's blocks alike)."""
    patterns = [
        (re.escape(glob).replace(r"\*", r"\d+"), style_name(style) in (ROWWISE, "packed-rowwise"))
        for glob, style in model_plan(model_class, adapter).items()
    ]
    rowwise = re.compile("|".join(f"(?:{p})" for p, row in patterns if row) or "(?!)")
    colwise = re.compile(
        "|".join([*(f"(?:{p})" for p, row in patterns if not row), *(f"(?:{p})" for p in adapter.tp_head_norms)])
        or "(?!)"
    )

    def dim(name: str) -> int | None:
        module, _, kind = name.rpartition(".")
        if kind == "weight" and rowwise.fullmatch(module):
            return 1
        if colwise.fullmatch(module) and (kind == "weight" or (kind == "bias" and not rowwise.fullmatch(module))):
            return 0
        return None

    return dim


def header_problems(tensors, model_class, adapter, tp: int) -> list[str]:
    """problems() from the tensors' names and shapes alone (a safetensors header's `(name, shape)` pairs), for a
    planner that has no module: a 2-D weight left whole beside split heads, and a plainly split weight (packed
    layers aside: their blocks are not in the header) whose split dim tp does not divide."""
    is_split = split_parameters(model_class, adapter)
    shapes = dict(tensors)
    attentions = [
        name.removesuffix("to_q.weight") for name in shapes if name.endswith(".to_q.weight") and is_split(name)
    ]
    whole = [
        name.removesuffix(".weight")
        for name, shape in shapes.items()
        if name.endswith(".weight") and len(shape) == 2 and not is_split(name) and name.startswith(tuple(attentions))
    ]
    if whole:
        return [
            f"tp {tp}: {model_class.__name__} has projections its tp plan does not split beside the heads it "
            f"splits ({', '.join(whole[:3])}{' and more' if len(whole) > 3 else ''}); use tp 1 for this model"
        ]
    styles = [
        (re.compile(re.escape(glob).replace(r"\*", r"\d+") + r"\.weight"), style_name(style))
        for glob, style in model_plan(model_class, adapter).items()
    ]
    narrow = [
        name.removesuffix(".weight")
        for name, shape in shapes.items()
        for pattern, style in styles
        if style in (COLWISE, ROWWISE, GATHERED) and pattern.fullmatch(name) and shape[style == ROWWISE] % tp
    ]
    if not narrow:
        return []
    return [
        f"tp {tp} does not divide the width of {len(narrow)} layer(s) of {model_class.__name__}: "
        f"{', '.join(narrow[:4])}{' and more' if len(narrow) > 4 else ''}; use a tp that divides them, or tp 1"
    ]
