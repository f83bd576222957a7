"""PipeFusion: stages of blocks, patches, stale K/V; exact with warmup covering every step."""

import pytest
import torch

from xdit_lab import ParallelConfig, ParallelConfigError, comm_log, parallelize
from xdit_lab.pipefusion import patch_ranges, stage_ranges
from xdit_lab.testing import run_on_ranks
from xdit_lab.tiny import tiny_inputs, tiny_transformer

LAYERS, STEPS = 4, 3


def _steps(config, family="pixart"):
    """STEPS transformer calls (one per diffusion step) with changing inputs, against serial."""
    model = tiny_transformer(family, layers=LAYERS)
    whole_params = sum(p.numel() for p in model.transformer_blocks.parameters())
    inputs = [tiny_inputs(family, 4, height=8, width=8, seed=s) for s in range(STEPS)]
    with torch.no_grad():
        reference = [model(**x).sample for x in inputs]
    model = parallelize(model, config)
    rows = []
    with torch.no_grad():
        for x, ref in zip(inputs, reference):
            with comm_log() as log:
                out = model(**x).sample
            rows.append(dict(error=(out - ref).abs().max().item(), bound=1e-4 * max(1.0, ref.abs().max().item()),
                             records=log.summary()))
    stage = model._xdit_lab_state.pipefusion
    return dict(rows=rows, staleness=stage.staleness(),
                block_params=sum(p.numel() for p in model.transformer_blocks.parameters()), whole=whole_params)


HYBRIDS = [ParallelConfig(pipefusion=2), ParallelConfig(pipefusion=2, num_patches=4),
           ParallelConfig(pipefusion=4), ParallelConfig(pipefusion=2, ulysses=2), ParallelConfig(pipefusion=2, ring=2),
           ParallelConfig(pipefusion=2, cfg=2), ParallelConfig(pipefusion=2, dp=2)]


@pytest.mark.parametrize("config", HYBRIDS, ids=lambda c: c.short() + f"·patches{c.patches}")
def test_warmup_over_every_step_equals_serial(config):
    config = config.replace(warmup_steps=STEPS)
    for rank, out in enumerate(run_on_ranks(_steps, config.world_size, config, timeout_s=180)):
        for step, row in enumerate(out["rows"]):
            assert row["error"] <= row["bound"], f"rank {rank} step {step}: {row['error']:.3g}"
        # a stage holds its blocks only: about P/N of the blocks' parameters
        assert out["block_params"] * config.pipefusion == out["whole"]


def test_stale_steps_deviate_and_are_recorded():
    """With warmup 1, steps after the first read K/V one step old: the result moves away from
    serial (staleness is real), each patch's slice records the step that wrote it."""
    config = ParallelConfig(pipefusion=2, num_patches=2, warmup_steps=1)
    for out in run_on_ranks(_steps, 2, config):
        errors = [row["error"] for row in out["rows"]]
        assert errors[0] <= out["rows"][0]["bound"]  # the warmup step is exact
        assert all(e > out["rows"][i + 1]["bound"] for i, e in enumerate(errors[1:]))  # stale afterwards
        written = out["staleness"]["written_step"]
        assert written and all(steps == [STEPS - 1, STEPS - 1] for steps in written.values())


def test_activations_between_stages_match_the_formula():
    """A pipelined step: each non-last stage sends every patch's activations once (B × S × hidden
    in all), the last stage broadcasts the noise prediction; no per-layer PipeFusion collective."""
    config = ParallelConfig(pipefusion=2, num_patches=4, warmup_steps=1)
    batch, tokens, hidden = 4, 16, 4 * 16
    for rank, out in enumerate(run_on_ranks(_steps, 2, config)):
        for step, row in enumerate(out["rows"]):
            pipefusion = [r for r in row["records"] if r["group"] == "pipefusion"]
            sends = [r for r in pipefusion if r["op"] == "send"]
            patches = 1 if step == 0 else 4
            assert len(sends) == (patches if rank == 0 else 0)
            assert sum(r["bytes"] for r in sends) == (batch * tokens * hidden * 4 if rank == 0 else 0)
            assert [r["op"] for r in pipefusion if r["op"] != "send"] == ["broadcast"]
            noise_bytes = batch * 8 * 8 * 8 * 4  # [B, out channels, H, W] float32
            assert pipefusion[-1]["bytes"] == noise_bytes


def test_stage_and_patch_splits():
    assert stage_ranges(28, 4) == [(0, 7), (7, 14), (14, 21), (21, 28)]
    assert stage_ranges(5, 2) == [(0, 3), (3, 5)]
    assert stage_ranges(5, 2, split=[1, 4]) == [(0, 1), (1, 5)]
    with pytest.raises(ValueError, match="at least one of the 5 blocks"):
        stage_ranges(5, 2, split=[5, 0])
    assert patch_ranges(4, 4, 2) == [(0, 8), (8, 16)]
    with pytest.raises(ValueError, match="5 patches are more than the 4 token rows"):
        patch_ranges(4, 4, 5)


def test_more_stages_than_blocks_is_refused():
    with pytest.raises(ParallelConfigError, match="2 transformer layers cannot fill 4 PipeFusion stages"):
        ParallelConfig(pipefusion=4).validate(4, num_layers=2)
