"""Controls are passed, not flipped (#56 point 5): a deliberately wrong variant is given to one model
(`parallelize(..., controls=Controls(...))`) and kept on its parallel state, so a control given to one
model leaves another model parallelized in the same process, on the same mesh, as it is: its strategy,
its buffers and its output. Before, the controls were class attributes that a test flipped for the whole
process, and a test that failed between the flip and its restore left the next one running the control.
No strategy class keeps a control, and nothing in the package, the tests or the benchmarks assigns an
attribute of a strategy's class."""

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from xdit_lab import ParallelConfig, RankMesh, parallelize
from xdit_lab.attention.stale import StaleKV
from xdit_lab.lessons.controls import ZeroStaleKV, wrong_stale_kv
from xdit_lab.models import Controls, PipeFusionStage, SequenceShards, parallel_state
from xdit_lab.models.cache import FirstBlockCache
from xdit_lab.testing import run_on_ranks
from xdit_lab.tiny import tiny_inputs, tiny_transformer

ROOT = Path(__file__).resolve().parent.parent


def _relative(a, b) -> float:
    return (a - b).abs().max().item() / max(1e-12, b.abs().max().item())


def _two_models(family, degrees, controls):
    """On this rank: the serial output, then a model given `controls` and one given none, parallelized
    in that order on one mesh and run alternately (two calls each: PipeFusion's second reads stale K/V)."""
    config = ParallelConfig(**degrees)
    mesh = RankMesh(config)
    inputs = tiny_inputs(family, 2)
    with torch.no_grad():
        serial = tiny_transformer(family, seed=0)(**inputs).sample
    controlled = parallelize(tiny_transformer(family, seed=0), config, mesh, controls=controls)
    plain = parallelize(tiny_transformer(family, seed=0), config, mesh)
    outputs = {"controlled": [], "plain": []}
    with torch.no_grad():
        for _ in range(2):
            outputs["controlled"].append(controlled(**inputs).sample)
            outputs["plain"].append(plain(**inputs).sample)
    strategies = {name: parallel_state(m).strategy for name, m in (("controlled", controlled), ("plain", plain))}
    return dict(
        serial=serial,
        outputs=outputs,
        controls={name: parallel_state(m).controls for name, m in (("controlled", controlled), ("plain", plain))},
        text_shard_at={name: getattr(s, "text_shard_at", None) for name, s in strategies.items()},
        buffers={
            name: sorted({type(b).__name__ for b in getattr(s, "buffers", {}).values()})
            for name, s in strategies.items()
        },
    )


@pytest.mark.timeout(240)
def test_a_control_given_to_one_model_leaves_another_as_it_is():
    # sequence shards: the text whole on the controlled model only; both exact (the control is more work)
    for rank in run_on_ranks(_two_models, 2, "flux", dict(ulysses=2), Controls(shards_text=False), timeout_s=180):
        assert rank["controls"]["controlled"] == Controls(shards_text=False)
        assert rank["controls"]["plain"] == Controls()
        assert rank["text_shard_at"] == {"controlled": None, "plain": "input"}
        for name in ("controlled", "plain"):
            assert _relative(rank["outputs"][name][0], rank["serial"]) < 1e-4, name
    # PipeFusion: zeros for the stale K/V on the controlled model only, which leaves the bound; the plain one
    # keeps StaleKV and equals a model run on its own
    alone = run_on_ranks(_two_models, 2, "pixart", dict(pipefusion=2), Controls(), timeout_s=180)
    together = run_on_ranks(_two_models, 2, "pixart", dict(pipefusion=2), wrong_stale_kv("zeros"), timeout_s=180)
    for rank_alone, rank in zip(alone, together):
        assert rank["buffers"]["controlled"] == [ZeroStaleKV.__name__]
        assert rank["buffers"]["plain"] == [StaleKV.__name__]
        assert torch.equal(rank["outputs"]["plain"][1], rank_alone["outputs"]["plain"][1])
        wrong = _relative(rank["outputs"]["controlled"][1], rank["outputs"]["plain"][1])
        assert wrong > 100 * _relative(rank["outputs"]["plain"][1], rank_alone["outputs"]["plain"][1]) + 1e-4, wrong


def test_controls_are_frozen_and_no_strategy_class_keeps_one():
    controls = Controls(shards_text=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        controls.shards_text = True
    for field in dataclasses.fields(Controls):
        for strategy in (SequenceShards, PipeFusionStage, FirstBlockCache):
            assert not hasattr(strategy, field.name), (strategy.__name__, field.name)
    assert wrong_stale_kv(None) == Controls()
    with pytest.raises(ValueError, match="unknown control 'ones'"):
        wrong_stale_kv("ones")


def test_nothing_assigns_an_attribute_of_a_strategy_class():
    assignment = re.compile(r"\b(SequenceShards|PipeFusionStage|FirstBlockCache)\.\w+\s*=(?!=)|\.cache\.agree\s*=")
    found = [
        f"{path.relative_to(ROOT)}:{number}"
        for folder in ("xdit_lab", "tests", "benchmarks")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if assignment.search(line)
    ]
    assert found == []
    # the control of this test: an assignment as the tests wrote them before is found
    assert assignment.search("        " + "PipeFusionStage" + ".drops_returned_latents = control")
    assert assignment.search("    parallel_state(t).cache" + ".agree = False")  # the cache's, flipped on its instance
