"""Adapter fields read from diffusers' `_cp_plan` (families/cp_plan.py): every family whose transformer declares
one takes them from it (its exactness under every strategy is tests/test_models.py's and test_pipelines.py's), and a
plan the hooks cannot follow, or a hand-written field the plan contradicts, is refused by name."""

import dataclasses
import inspect

import diffusers
import pytest
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

from xdit_lab.families import FAMILIES, adapter_for
from xdit_lab.families.cp_plan import derived_fields, with_plan
from xdit_lab.tiny import tiny_transformer

PLANNED = sorted(name for name in FAMILIES if vars(getattr(diffusers, name)).get("_cp_plan"))


def test_every_family_with_a_cp_plan_takes_its_fields_from_it():
    """A family whose diffusers transformer declares a _cp_plan writes none of what it says by hand. Flux, Flux.2,
    Qwen-Image and Wan in diffusers 0.42; a release that adds one to another family fails here until that family
    reads it."""
    assert {"FluxTransformer2DModel", "Flux2Transformer2DModel", "QwenImageTransformer2DModel"} <= set(PLANNED)
    assert {name for name, adapter in FAMILIES.items() if adapter.from_cp_plan} == set(PLANNED)


@pytest.mark.parametrize("class_name", PLANNED)
def test_a_parallelized_model_gets_the_plan_s_fields(class_name):
    """adapter_for gives the model the plan's gather, rotary tables and per-token arguments: the fields the hooks
    install (models/hooks.py), read from the class, not written in the family file."""
    family = FAMILIES[class_name].family
    adapter = adapter_for(tiny_transformer(family))
    plan = getattr(diffusers, class_name)._cp_plan
    assert not adapter.from_cp_plan and adapter.gather_at in plan
    assert adapter.rotary_at is None or isinstance(next(iter(plan[adapter.rotary_at])), int)
    declared = {a for entry in plan.values() if isinstance(entry, dict) for a in entry if isinstance(a, str)}
    assert {entry.argument for entry in adapter.per_token} & declared == {
        a for a in declared if a not in ("hidden_states", "encoder_hidden_states", "txt_ids") and "mask" not in a
    }


def test_every_cp_plan_in_diffusers_is_read_or_refused_by_name():
    """Each _cp_plan diffusers ships: its fields derived, or a TypeError naming the class and the fix (Helios cuts and
    gathers around every block, MiniMax-H3 gathers two outputs)."""
    read, refused = [], []
    for name in dir(diffusers):
        cls = getattr(diffusers, name, None)
        if not (inspect.isclass(cls) and "_cp_plan" in vars(cls) and cls._cp_plan):
            continue
        try:
            fields = derived_fields(cls)
        except TypeError as error:
            assert name in str(error) and "by hand" in str(error), error
            refused.append(name)
        else:
            assert fields["gather_at"] in cls._cp_plan, name
            read.append(name)
    assert set(PLANNED) <= set(read) and len(read) >= 6
    assert {"HeliosTransformer3DModel", "MiniMaxH3Transformer3DModel"} <= set(refused)


def _plan_of(plan):
    return type("PlannedTransformer", (), {"_cp_plan": plan})


def test_a_plan_entry_the_hooks_do_not_read_is_refused():
    """Control: what the table of cp_plan.py does not cover is not half applied."""
    ok = {"": {"hidden_states": ContextParallelInput(1, 3)}, "proj_out": ContextParallelOutput(1, 3)}
    assert derived_fields(_plan_of(ok))["gather_at"] == "proj_out"
    split_output_argument = dict(ok, rope={"freqs": ContextParallelInput(1, 3, split_output=True)})
    no_dims = dict(ok, norm_out={"temb": ContextParallelInput(1)})
    two_gathers = dict(ok, audio_proj_out=ContextParallelOutput(1, 3))
    for plan, said in [(split_output_argument, "does not read"), (no_dims, "expected_dims"), (two_gathers, "2 mod")]:
        with pytest.raises(TypeError, match=said):
            derived_fields(_plan_of(plan))
    with pytest.raises(TypeError, match="declares no _cp_plan"):
        derived_fields(_plan_of({}))


def test_a_hand_written_field_the_plan_contradicts_is_refused():
    """A family file that says otherwise than its transformer's plan is an error at parallelize, naming both."""
    flux = FAMILIES["FluxTransformer2DModel"]
    wrong = dataclasses.replace(flux, gather_at="norm_out")
    with pytest.raises(TypeError, match=r"gather_at='norm_out'.*declares 'proj_out'"):
        with_plan(wrong, diffusers.FluxTransformer2DModel)
    agreeing = dataclasses.replace(flux, text_shard_at="input")  # the same as the plan: taken
    assert with_plan(agreeing, diffusers.FluxTransformer2DModel).text_shard_at == "input"
