"""Tensor parallelism inside PipeFusion stages (tp2·pf2 on 4 ranks) against diffusers' serial forward.

The grid puts tp fastest: ranks 0, 1 are stage 0's two tp ranks, 2, 3 stage 1's; the pipefusion groups are {0, 2}
and {1, 3}, so each stage's rank of tp coordinate t hands its patches (whole, after the rowwise all-reduce) to the
next stage's rank of coordinate t. Each rank holds its stage's blocks, split: the parameter bytes it holds equal the
plan's, and the stale K/V it keeps are its heads' alone, half the stage's, as planned. Every step's bytes per group
(tp's and pipefusion's) equal the closed form. The pipelines under tp2·pf2 are in tests/test_tensor_parallel.py,
the planned and held K/V of a pipeline's request in tests/test_pipefusion.py, every family's tp2·pf2 forward (every step
warmed up) in tests/test_tp_families.py."""

import pytest
from test_pipefusion import CONTROLS, STEPS, _check_stale_bound, _steps
from test_tensor_parallel import _held_bytes

from xdit_lab import ParallelConfig, ParallelConfigError, parallelize
from xdit_lab.models import parallel_state
from xdit_lab.testing import run_on_ranks
from xdit_lab.tiny import tiny_transformer

TP_PF = ParallelConfig(tp=2, pipefusion=2)
BATCH = 4  # test_pipefusion._inputs' batch: every row on every rank (no cfg, no dp)


def _held(model, whole: int) -> dict:
    """What this rank holds after the steps: its parameter bytes (a DTensor's shard) against the tp plan's for its
    stage, the stage's parameter bytes against the whole model's, the stale K/V held against planned, and the
    stale K/V of every head of its layers, every token, every row (what a stage keeps without tp: tp halves it)."""
    state = parallel_state(model)
    stage, tensor = state.strategy, state.tensor
    grid, appended = stage.grid
    buffers = list(stage.buffers.values())
    heads, head_dim = state.adapter.attention_shape(model.config)
    tokens = grid[0] * grid[1] + sum(rows * cols for rows, cols in appended)
    every_head = len(buffers) * 2 * BATCH * heads * tokens * head_dim * 4  # K and V, float32
    return dict(
        held=_held_bytes(model),
        planned=tensor.planned_bytes,
        stage_whole=tensor.whole_bytes,
        whole=whole,
        kept=stage.report().kept_bytes["stale K/V"],
        planned_kept=stage.planned_kept_bytes(model, BATCH, grid, appended)["stale K/V"],
        every_head=every_head,
        layers=len(buffers),
    )


def _exact_and_stale(families):
    """Per family: every step warmed up (exact), and warm-up 1 (stale) with both wrong buffers as controls."""
    runs = {}
    for family in families:
        stale = TP_PF.replace(warmup_steps=1)
        runs[family] = dict(
            exact=_steps(TP_PF.replace(warmup_steps=STEPS), family, extra=_held),
            # Flux's stages of one stream each: a stage's other list of blocks is empty, its plan's globs name none
            split=_steps(TP_PF.replace(warmup_steps=STEPS, stage_split=(4, 2)), family, extra=_held)
            if family == "flux"
            else None,
            stale=_steps(stale, family, extra=_held),
            controls={kind: _steps(stale, family, control=kind) for kind in CONTROLS} if family == "flux" else {},
        )
    return runs


@pytest.mark.timeout(600)
def test_tp2_pf2_equals_serial_diffusers_and_keeps_half_the_stale_kv():
    """Flux (double- then single-stream blocks: stage 0 holds 3 double-stream blocks, stage 1 one and the
    single-stream ones) and SD3 under tp2·pf2: every step within 1e-4 of diffusers' serial forward when every step
    warms up (Flux's also with stage_split (4, 2): one stream a stage); after warm-up 1 the stale steps deviate within Flux's measured bound (test_pipefusion.STALE_L2), which
    both wrong buffers exceed. In every run each step's bytes per group equal the closed form (tp and pipefusion
    both moving), a rank holds its stage's blocks split as planned, and keeps the stale K/V of its half of the
    heads, as planned."""
    from forward_traffic import traffic_mismatches

    for rank, runs in enumerate(run_on_ranks(_exact_and_stale, 4, ("flux", "sd3"), timeout_s=540)):
        stage = rank // 2
        for family, run in runs.items():
            where = f"{family} tp2·pf2 rank {rank}"
            exact = [name for name in ("exact", "split") if run[name] is not None]
            for name in exact:
                for step, row in enumerate(run[name]["rows"]):
                    assert row["error"] <= row["bound"], f"{where} {name} step {step}: {row['error']:.3g}"
            stale = run["stale"]["rows"]
            assert stale[0]["error"] <= stale[0]["bound"], where  # the warm-up step
            assert all(row["error"] > row["bound"] for row in stale[1:]), where  # stale afterwards
            for name in (*exact, "stale"):
                rows = run[name]["rows"]
                assert not traffic_mismatches(rows, f"{where} {name}"), traffic_mismatches(rows, where)
                assert all({"tp", "pipefusion"} <= set(row["moved"]) for row in rows), where
                held = run[name]["extra"]
                assert held["held"] == held["planned"], f"{where}: held {held['held']}, planned {held['planned']}"
                assert held["held"] < 0.6 * held["stage_whole"] and held["stage_whole"] < held["whole"], where
                assert held["layers"] > 0 and held["kept"] == held["planned_kept"], f"{where} {name}: {held}"
                assert 2 * held["kept"] == held["every_head"], where  # its own heads' K/V: half of every head's
            if run["controls"]:
                _check_stale_bound(family, run["stale"], run["controls"], where)
        # stage 0 sends its patches on the pipefusion link; the last stage broadcasts the prediction
        sends = [r for r in runs["flux"]["exact"]["rows"][0]["records"] if r["op"] == "send"]
        assert bool(sends) == (stage == 0) and all(r["group"] == "pipefusion" for r in sends), sends


def test_tp_refuses_the_async_schedule_and_a_cache_under_pipefusion():
    from xdit_lab.accelerations import StepCache

    said = " ".join(ParallelConfig(tp=2, pipefusion=2, pipefusion_schedule="async").problems())
    assert "not yet with pipefusion_schedule='async'" in said
    assert ParallelConfig(tp=2, pipefusion=2).problems() == []
    with pytest.raises(ParallelConfigError, match=r"a cache \(xdit_lab's StepCache\) is not composed with tp 2 under"):
        parallelize(tiny_transformer("flux"), TP_PF, cache=StepCache(threshold=0.1))


def test_each_pipefusion_group_is_one_tp_coordinate_s_stages():
    """The grid alone (no process): tp pairs are neighbours, each pipefusion group and link joins the stages of one
    tp coordinate, and a stage's neighbours are the ranks of its own coordinate."""
    from xdit_lab import RankMesh

    meshes = [RankMesh(TP_PF, rank=r, world_size=4) for r in range(4)]
    assert meshes[0].all_groups("tp") == [[0, 1], [2, 3]]
    assert meshes[0].all_groups("pipefusion") == [[0, 2], [1, 3]]
    assert meshes[0].all_links() == [(0, 2), (1, 3)]
    assert [m.pipeline_next for m in meshes[:2]] == [2, 3] and [m.pipeline_prev for m in meshes[2:]] == [0, 1]


FAMILIES = ("flux", "flux2", "qwenimage", "wan", "hunyuanvideo", "cogvideox", "sd3", "pixart", "zimage", "dit")
FAMILIES += ("hunyuanvideo15",)  # every family with a tp plan


def test_the_layers_tp_counts_after_the_blocks_run_after_them_in_every_family():
    """tensor_parallel.after_blocks names the planned layers outside the blocks that only PipeFusion's last stage
    runs; each family's own forward (tiny, serial) runs exactly those after its last block, the others before its
    first (PixArt's shared modulation, registered after its blocks, runs before them)."""
    import torch
    from test_tensor_parallel import BATCH as TP_BATCH
    from test_tensor_parallel import HEADS, TEXT

    from xdit_lab.families import adapter_for
    from xdit_lab.families.tp_plan import model_plan
    from xdit_lab.models.tensor_parallel import after_blocks, expand
    from xdit_lab.tiny import tiny_inputs

    for family in FAMILIES:
        model = tiny_transformer(family, seed=0, heads=HEADS.get(family))
        adapter = adapter_for(model)
        inputs = tiny_inputs(family, TP_BATCH, height=8, width=8, text_len=TEXT)
        blocks = [f"{name}.{i}" for name in adapter.block_lists for i in range(len(getattr(model, name)))]
        outside = [n for n in expand(model, model_plan(type(model), adapter)) if not n.startswith(tuple(blocks))]
        order, handles = [], []
        for name in [*outside, *blocks]:
            hook = lambda *_, name=name, order=order: order.append(name)  # noqa: E731
            handles.append(model.get_submodule(name).register_forward_hook(hook))
        with torch.no_grad():
            model(**inputs)
        for handle in handles:
            handle.remove()
        last = max(i for i, name in enumerate(order) if name in blocks)
        ran_after = {name for name in outside if order.index(name) > last}
        assert {name for name in outside if after_blocks(name)} == ran_after, f"{family}: {outside}, {order}"
