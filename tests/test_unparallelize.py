"""unparallelize undoes parallelize (#56 point 6): every hook and replaced forward parallelize installs is
listed by name in parallel_state(model).hooks, every hook on the parallelized model is one of them (a hook
installed around the list would be caught here), and after unparallelize the model has no hook and no
instance forward left, runs as a freshly built serial model (relative 1e-5, float32), and can be
parallelized again. Control: without unparallelize, parallelize still refuses the model."""

import pytest
import torch

from xdit_lab import ParallelConfig, RankMesh, StepCache, parallelize, unparallelize
from xdit_lab.families import adapter_for
from xdit_lab.models import parallel_state
from xdit_lab.testing import run_on_ranks
from xdit_lab.tiny import tiny_inputs, tiny_transformer

CASES = [  # (id, family, config, StepCache threshold or None, a mesh passed in)
    ("flux-ulysses2-cache", "flux", dict(ulysses=2), 0.0, False),  # dispatcher attention, rotary, cache wrappers
    ("pixart-ulysses2-own-mesh", "pixart", dict(ulysses=2), None, True),  # rebound SDPA processors
    ("pixart-pipefusion2", "pixart", dict(pipefusion=2), None, False),
    ("dit-pipefusion2", "dit", dict(pipefusion=2), None, False),  # stage 1 borrows block 0's embedding
    ("sana-ring2", "sana", dict(ring=2), None, False),  # our linear-attention processor, row hooks, halo forwards
]
# a later stage without block 0 cannot condition DiT's output layer: parallelize refuses it as a stage
AGAIN_REFUSED = {"dit"}


def _relative(a, b) -> float:
    return (a - b).abs().max().item() / max(1e-12, b.abs().max().item())


def _hooks_on(model) -> set[int]:
    return {key for m in model.modules() for hooks in (m._forward_hooks, m._forward_pre_hooks) for key in hooks}


def _processors(model) -> list[str]:
    return [f"{name}:{type(m.processor).__name__}" for name, m in model.named_modules() if hasattr(m, "processor")]


def _cycle(family, degrees, threshold, pass_mesh):
    config = ParallelConfig(**degrees)
    cache = None if threshold is None else StepCache(threshold)
    mesh = RankMesh(config) if pass_mesh else None
    inputs = tiny_inputs(family, 2)
    model = parallelize(tiny_transformer(family, seed=0), config, mesh, cache=cache)
    state = parallel_state(model)
    names = list(state.hooks.names)
    stray = _hooks_on(model) - {handle.id for handle in state.hooks.handles()}
    with torch.no_grad():
        parallel = model(**inputs).sample
    try:
        parallelize(model, config, mesh)
        refused = None
    except ValueError as error:
        refused = str(error)

    assert unparallelize(model) is model
    fresh = tiny_transformer(family, seed=0)
    stage = getattr(model, "_xdit_lab_stage_blocks", None)
    if stage is not None:  # a PipeFusion stage keeps its own blocks only
        adapter_for(fresh).keep_blocks(fresh, *stage[:2])
    with torch.no_grad():
        serial, reference = model(**inputs).sample, fresh(**inputs).sample
    result = dict(
        names=names,
        stray=sorted(stray),
        refused=refused,
        left_hooks=[name for name, m in model.named_modules() if m._forward_hooks or m._forward_pre_hooks],
        left_forwards=[name for name, m in model.named_modules() if "forward" in vars(m)],
        processors=_processors(model) == _processors(fresh),
        modules=[name for name, _ in model.named_modules()] == [name for name, _ in fresh.named_modules()],
        state=parallel_state(model),
        mesh_closed=state.mesh.closed,
        serial_error=_relative(serial, reference),
    )
    if family in AGAIN_REFUSED:
        result["again_error"] = 0.0
    else:
        parallelize(model, config, mesh, cache=None if threshold is None else StepCache(threshold))
        with torch.no_grad():
            result["again_error"] = _relative(model(**inputs).sample, parallel)
        unparallelize(model)
    if mesh is not None:
        mesh.close()
    return result


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_unparallelize_leaves_a_fresh_model(case):
    _, family, degrees, threshold, pass_mesh = case
    for rank, row in enumerate(run_on_ranks(_cycle, 2, family, degrees, threshold, pass_mesh, timeout_s=180)):
        where = f"rank {rank}: {row}"
        assert row["names"], where
        assert row["stray"] == [], f"hooks installed outside parallel_state(model).hooks, {where}"
        assert row["refused"] and "already parallelized" in row["refused"], where
        assert row["left_hooks"] == [] and row["left_forwards"] == [], where
        assert row["processors"] and row["modules"] and row["state"] is None, where
        assert row["mesh_closed"] is not pass_mesh, where  # closed only where parallelize made it
        assert row["serial_error"] <= 1e-5, where
        assert row["again_error"] <= 1e-5, where
        if "ulysses" in degrees:
            assert any(name.startswith("attention[") for name in row["names"]), where
            assert "shard[" + adapter_for(tiny_transformer(family)).shard_at + "]" in row["names"], where
        if threshold is not None:
            assert "step_cache[0]" in row["names"], where
        if "pipefusion" in degrees:
            assert {"pipefusion.hand_over", "pipefusion.take_incoming"} & set(row["names"]), where
