r"""The adapter fields diffusers' `_cp_plan` already declares, read from the transformer's class.

diffusers' transformers that run its own context parallelism say where it splits and gathers
(`ContextParallelInput`, `ContextParallelOutput`: diffusers/models/_modeling_parallel.py). Those are
facts a FamilyAdapter would otherwise restate by hand, so an adapter made with `from_cp_plan=True`
takes them from the class when its model is parallelized:

    _cp_plan entry                                               adapter field
    "proj_out": ContextParallelOutput(gather_dim=1)              gather_at = "proj_out"
    "rope": {0: CPInput(split_output=True), 1: ...}              rotary_at = "rope" (tables cut per token)
    "":                     {"encoder_hidden_states": ...}       text_shard_at = "input" (the forward's text)
    "transformer_blocks.0": {"encoder_hidden_states": ...}       text_shard_at = "block" (as block 0 takes it)
    "": {"txt_ids": CPInput(split_dim=0, expected_dims=2)}       text_rows_kwarg = "txt_ids"
    ...{"encoder_hidden_states_mask": ...}                       text_key_mask = True
    "": {"timestep": CPInput(split_dim=1, expected_dims=2)}      per_token += PerToken("", "timestep", -1, dims=2)
    "transformer_blocks.*": {"modulate_index": ...}              per_token += PerToken(r"^transformer_blocks\.\d+$", ...)

A per-token argument is cut on its token dimension counted from the end, so ids given with or without their
batch dimension are cut alike; where the token dimension is the last one, only a tensor of the declared rank is
per token (Wan 2.2's timestep is [B, S], Wan 2.1's a per-sample [B]).

What the plan cannot say stays by hand: where the image tokens are cut (`shard_at`: diffusers splits the raw
latents or block 0's input; the hooks cut the embedding's output, positions added), each attention module's
kind, the latent and rotary layouts, the block lists, what is unbatched. A field given by hand and declared
differently by the plan is an error, and so is a plan entry not in the table above: a new diffusers plan is
read exactly or refused by name, never half applied."""

from __future__ import annotations

import dataclasses
import re

from .adapter import FamilyAdapter, PerToken

IMAGE = "hidden_states"
TEXT = "encoder_hidden_states"
TEXT_MASKS = ("encoder_hidden_states_mask", "encoder_attention_mask")
TEXT_IDS = "txt_ids"


def derived_fields(transformer_class) -> dict:
    """{adapter field: value} from `transformer_class._cp_plan` (see the module's table)."""
    plan = getattr(transformer_class, "_cp_plan", None)
    if not plan:
        raise TypeError(f"{transformer_class.__name__} declares no _cp_plan; write its adapter's fields by hand")
    gathers = [module for module, entry in plan.items() if type(entry).__name__ == "ContextParallelOutput"]
    image_cuts = [module for module, entry in plan.items() if isinstance(entry, dict) and IMAGE in entry]
    if len(gathers) != 1 or len(image_cuts) > 1:  # Helios cuts and gathers around every block, MiniMax-H3 two outputs
        raise TypeError(
            f"{transformer_class.__name__}._cp_plan gathers at {len(gathers)} modules and cuts the image at "
            f"{len(image_cuts)}: xdit_lab's hooks cut the image tokens once and gather them once; write the "
            f"adapter's fields by hand (FamilyAdapter without from_cp_plan)"
        )
    fields, per_token = {"gather_at": gathers[0]}, []
    for module, entry in plan.items():
        if module == gathers[0]:
            continue
        if all(isinstance(key, int) for key in entry) and all(e.split_output for e in entry.values()):
            fields["rotary_at"] = module  # a module's outputs cut per token: its rotary tables
            continue
        for argument, split in entry.items():
            if not isinstance(argument, str) or split.split_output:
                raise TypeError(_unknown(transformer_class, module, argument, split))
            if argument == IMAGE:
                continue  # where the image tokens are cut is the adapter's shard_at (by hand)
            if argument == TEXT:
                fields["text_shard_at"] = "input" if module == "" else "block"
            elif argument in TEXT_MASKS:
                fields["text_key_mask"] = True
            elif argument == TEXT_IDS and module == "":
                fields["text_rows_kwarg"] = argument
            else:
                per_token.append(_per_token(module, argument, split))
    fields["per_token"] = tuple(per_token)
    return fields


def _per_token(module: str, argument: str, split) -> PerToken:
    dims = split.expected_dims
    if dims is None:
        raise TypeError(f"_cp_plan's {argument!r} at {module!r} gives no expected_dims: its token dimension is unknown")
    token_last = split.split_dim == dims - 1
    pattern = "" if module == "" else "^" + re.escape(module).replace(r"\*", r"\d+") + "$"
    return PerToken(pattern, argument, dim=split.split_dim - dims, dims=dims if token_last else None)


def _unknown(transformer_class, module, argument, split) -> str:
    return (
        f"{transformer_class.__name__}._cp_plan splits {argument!r} at {module!r} as {split!r}, which xdit_lab does "
        f"not read; write the adapter's fields by hand (FamilyAdapter without from_cp_plan)"
    )


def with_plan(adapter: FamilyAdapter, transformer_class) -> FamilyAdapter:
    """`adapter` with the fields `transformer_class._cp_plan` declares filled in (its own per-token
    arguments first, then the plan's)."""
    fields = derived_fields(transformer_class)
    defaults = {f.name: f.default for f in dataclasses.fields(FamilyAdapter) if f.default is not dataclasses.MISSING}
    for name, value in fields.items():
        given = getattr(adapter, name)
        if name != "per_token" and given != defaults[name] and given != value:
            raise TypeError(
                f"the {adapter.family} adapter gives {name}={given!r}, but {transformer_class.__name__}._cp_plan "
                f"declares {value!r}: leave the field to the plan"
            )
    fields["per_token"] = (*adapter.per_token, *fields["per_token"])
    return dataclasses.replace(adapter, from_cp_plan=False, **fields)
