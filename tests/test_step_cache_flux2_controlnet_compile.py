"""StepCache where it was refused before: Flux.2, a ControlNet pipeline, and torch.compile.

Flux.2   diffusers' First-Block Cache raises on it (its tail ends in a single-stream block that returns
         [text; image] as one tensor, from which diffusers subtracts the head block's (text, image) pair:
         run here, so a diffusers that learns it shows up). The reference is therefore diffusers' own
         Flux2Transformer2DModel run serially with First-Block Cache's rule applied by two hooks written
         here (_by_hand): the first block's image residual decides, the last block's output becomes the
         first block's [text; image] plus the tail's difference at the last full step. Six calls under
         ulysses 2, ring 2, dp 2 and PipeFusion 2 (every step a warmup step: exact) skip the steps it skips
         and equal its outputs; at threshold 0 nothing skips and the outputs equal the model without a cache.
         Past its warmup, PipeFusion's stages skip together and stay within a bound of the rule (measured).
ControlNet  diffusers' FluxControlNetPipeline opens no cache context, so diffusers applies no First-Block
         Cache to it (and its hooks raise on SD3): the reference is our own pipeline, for Flux and SD3. At threshold 0 every strategy equals the same
         pipeline without a cache; at a threshold that skips, every strategy takes the serial run's
         decisions and equals its latents (1e-4), and the serial run is within a bound of the uncached one
         that the control, a cache that keeps the ControlNet's residuals in what it caches
         (Controls(cache_keeps_block_residuals=True)), exceeds.
compile  the decision's host sync breaks the graph; dynamo traces a set of graphs per decision and none
         after: from the first call that skips and the first that runs after it, the graph and recompile
         counts stay fixed over the remaining calls, outputs and skips equal eager's and the bytes recorded
         are the same.
Every rank above one agrees on each decision: one all-reduce tagged "cache" per call after the first,
and each call's bytes equal the closed form told the skips."""

import pytest
import torch
from forward_traffic import session_traffic, traffic_mismatches, traffic_row

from xdit_lab import ParallelConfig, RankMesh, StepCache, comm_log, load_pipeline, parallelize
from xdit_lab.models import Controls, parallel_state
from xdit_lab.testing import run_on_ranks
from xdit_lab.tiny import tiny_inputs, tiny_transformer

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 6
FLUX2_CONFIGS = [
    ParallelConfig(ulysses=2),
    ParallelConfig(ring=2),
    ParallelConfig(dp=2),
    ParallelConfig(pipefusion=2, num_patches=2, warmup_steps=STEPS),
    # the second stage starts at the first single-stream block: its tail takes [text; image] joined
    ParallelConfig(pipefusion=2, num_patches=2, warmup_steps=STEPS, stage_split=(4, 2)),
]


def _calls(family):
    """Six transformer calls on a slowly changing latent, as steps are."""
    base = tiny_inputs(family, 2, height=8, width=8)
    noise = torch.randn(base["hidden_states"].shape, generator=torch.Generator().manual_seed(3))
    return [dict(base, hidden_states=base["hidden_states"] + 0.05 * i * noise) for i in range(STEPS)]


def _by_hand(model, threshold):
    """First-Block Cache's rule on Flux.2's serial model, by two forward hooks: the first block's image residual
    against the one of the last full step (mean |r - r_full| / mean |r_full| <= threshold: skip, as diffusers'
    FBCHeadBlockHook); the last block's output [text; image] replaced, at a skipped step, by the first block's
    [text; image] plus what the tail added at the last full step. Returns the list of skips, one per call."""
    memo, skips = {}, []

    def after_first(_module, _args, kwargs, output):
        text, image = output
        residual = image - kwargs["hidden_states"]
        full = memo.get("residual")
        change = None if full is None else ((residual - full).abs().mean() / full.abs().mean()).item()
        skips.append(change is not None and change <= threshold)
        if not skips[-1]:
            memo["residual"] = residual
        memo["head"] = torch.cat([text, image], dim=1)

    def after_last(_module, _args, _kwargs, output):
        if skips[-1]:
            return memo["head"] + memo["tail"]
        memo["tail"] = output - memo["head"]

    model.transformer_blocks[0].register_forward_hook(after_first, with_kwargs=True)
    model.single_transformer_blocks[-1].register_forward_hook(after_last, with_kwargs=True)
    return skips


def _flux2_calls(configs, threshold, controls=None):
    """On every rank: the reference (_by_hand at `threshold`; the model without a cache at 0) and each
    configuration's StepCache(threshold) over the six calls (with `controls`, where given)."""
    calls = _calls("flux2")
    reference = tiny_transformer("flux2", layers=4)
    expected_skips = _by_hand(reference, threshold) if threshold else None
    with torch.no_grad():
        expected = [reference(**x).sample for x in calls]
    rows = []
    for config in configs:
        model = tiny_transformer("flux2", layers=4)
        model = parallelize(model, config, RankMesh(config), cache=StepCache(threshold), controls=controls)
        outs, traffic, agreed = [], [], []
        with torch.no_grad():
            for step, x in enumerate(calls):
                with comm_log() as log:
                    outs.append(model(**x).sample)
                traffic.append(traffic_row(model, x, log, step))
                agreed.append(sum(r.tag == "cache" for r in log))
        cache = parallel_state(model).cache
        rows.append(
            dict(
                config=config.short(),
                error=max((o - e).abs().max().item() for o, e in zip(outs, expected)),
                skips=list(cache.skips),
                changes=list(cache.changes),
                traffic=traffic,
                agreed=agreed,
            )
        )
    largest = max(e.abs().max().item() for e in expected)
    return dict(rows=rows, largest=largest, expected_skips=expected_skips or [False] * STEPS)


def _check_calls(per_rank, skipping):
    for rank, out in enumerate(per_rank):
        assert any(out["expected_skips"]) == skipping and not all(out["expected_skips"][1:]), out["expected_skips"]
        for row in out["rows"]:
            where = f"flux2 {row['config']} rank {rank}"
            assert row["error"] <= 1e-4 * max(1.0, out["largest"]), f"{where}: {row['error']:.3g}"
            assert row["skips"] == out["expected_skips"], (where, row["changes"])
            assert row["skips"] == per_rank[0]["rows"][out["rows"].index(row)]["skips"], f"{where}: ranks disagree"
            assert row["agreed"] == [0] + [1] * (STEPS - 1), where  # one all-reduce per decision, tag "cache"
            assert not traffic_mismatches(row["traffic"], where), traffic_mismatches(row["traffic"], where)


def test_diffusers_first_block_cache_raises_on_flux2():
    """Were this to pass through, Flux.2 would be compared with diffusers' First-Block Cache itself."""
    from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache
    from diffusers.hooks.hooks import CacheContext, _set_cache_context

    model = tiny_transformer("flux2", layers=4)
    apply_first_block_cache(model, FirstBlockCacheConfig(threshold=0.05))
    _set_cache_context(model, CacheContext("all"))
    with torch.no_grad(), pytest.raises(TypeError, match="unsupported operand"):
        model(**_calls("flux2")[0])


@pytest.mark.parametrize("threshold", [0.0, 0.1], ids=["threshold 0", "threshold 0.1"])
def test_flux2_equals_first_block_cache_by_hand_under_every_strategy(threshold):
    per_rank = run_on_ranks(_flux2_calls, 2, FLUX2_CONFIGS, threshold, timeout_s=300)
    _check_calls(per_rank, skipping=threshold > 0)


# what stale PipeFusion 2 (past its first call) may differ from the serial rule, relative to its largest output:
# measured 0.00082; the control (stale K/V read as zeros) exceeds it
STALE_BOUND = 0.005


def _stale_and_control(config, threshold):
    from xdit_lab.lessons.controls import ZeroStaleKV

    return _flux2_calls([config], threshold), _flux2_calls([config], threshold, Controls(buffer_type=ZeroStaleKV))


def test_flux2_under_stale_pipefusion_takes_one_decision_on_every_stage():
    """PipeFusion 2 past its first call (stale K/V): the stages skip together, one all-reduce per decision, each
    call's bytes equal the closed form told the skips (stage 0 still hands every patch over at a skipped step),
    and the outputs stay within STALE_BOUND of the serial rule, which the control (zeros for the stale K/V)
    exceeds."""
    config = ParallelConfig(pipefusion=2, num_patches=2, warmup_steps=1)
    per_rank = run_on_ranks(_stale_and_control, 2, config, 0.1, timeout_s=300)
    first = per_rank[0][0]["rows"][0]
    for rank, (out, control) in enumerate(per_rank):
        (row,), (wrong,) = out["rows"], control["rows"]
        assert row["skips"] == first["skips"] and any(row["skips"]), (rank, row["changes"])
        assert row["agreed"] == [0] + [1] * (STEPS - 1), rank
        assert not traffic_mismatches(row["traffic"], f"stage {rank}"), traffic_mismatches(row["traffic"])
        assert row["error"] / out["largest"] <= STALE_BOUND < wrong["error"] / out["largest"], (row, wrong)


# ---- a ControlNet -----------------------------------------------------------------------------------------------

CONTROLNET_CONFIGS = [ParallelConfig(ulysses=2), ParallelConfig(ring=2), ParallelConfig(dp=2), ParallelConfig(cfg=2)]
# PipeFusion, every step a warmup step (exact), the second stage starting in a block list whose residuals differ
# block by block (as tests/test_controlnet_pipelines.py splits them): Flux's in its single-stream blocks, SD3's at
# joint block 1 of 3
CONTROLNET_PIPEFUSION = {
    "flux": ParallelConfig(pipefusion=2, warmup_steps=STEPS, stage_split=(3, 1)),
    "sd3": ParallelConfig(pipefusion=2, warmup_steps=STEPS, stage_split=(1, 2)),
}
# per family: the threshold, the steps it skips, and what the cached latents may differ from the uncached ones
# (relative to their largest value). Flux's changes from the second step: 0.471, 0.432, 0.526, 0.588, 0.491 (the
# control's 0.619 at the fourth): 0.55 skips steps 1, 2 (the ControlNet guiding) and 3, 5 (scale 0), each change
# 4% or more away; measured 0.0107 from the uncached latents, the control 0.133 at the same skips. SD3's: 0.444,
# 0.586, 0.420, 0.509, 0.456: 0.5 skips steps 1 (guiding), 3 and 5 (scale 0), each change 1.8% or more away;
# measured 0.0136, the control 0.700.
CONTROLNET_CASES = {
    "flux": (0.55, [False, True, True, True, False, True], 0.03),
    "sd3": (0.5, [False, True, False, True, False, True], 0.03),
}


@pytest.fixture(scope="module")
def controlnet_folders(tmp_path_factory):
    """Flux's and SD3's tiny pipelines with a ControlNet of random (non-zero) output layers, saved as their
    ControlNet pipelines (tests/test_controlnet_pipelines.py's, SD3's with three joint blocks)."""
    import diffusers
    from test_controlnet_pipelines import PIPELINES, _controlnet

    from xdit_lab.tiny import tiny_pipeline

    folders = {}
    for family, pipeline_class in PIPELINES.items():
        parts = tiny_pipeline(family).components
        if family == "sd3":
            parts["transformer"] = tiny_transformer("sd3", layers=3)
        pipe = getattr(diffusers, pipeline_class)(**parts, controlnet=_controlnet(family, parts["transformer"]))
        folders[family] = tmp_path_factory.mktemp(f"{family}_controlnet")
        pipe.save_pretrained(folders[family], safe_serialization=True)
    return folders


def _controlnet_call(family):
    """Six steps of CFG, the ControlNet guiding the first three (scale 0.7) and none after (scale 0)."""
    from test_controlnet_pipelines import _call

    return _call(family, num_inference_steps=STEPS)


def _controlnet_runs(folder, family, configs, cases):
    """On every rank: each configuration run with each case (threshold, controls or None), as rows."""
    from xdit_lab.lessons.families import output_latents

    rows = []
    for config in configs:
        for threshold, controls in cases:
            cache = None if threshold is None else StepCache(threshold)
            pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False, cache=cache, controls=controls)
            session = pipe.session(["a red cat", "a blue dog"], seed=0, **_controlnet_call(family)).run()
            result = session.result(output_type="latent")
            rows.append(
                dict(
                    config=config.short(),
                    threshold=threshold,
                    latents=output_latents(result),
                    skips=list(result.cache_skips) if cache else None,
                    changes=list(session.cache_changes) if cache else None,
                    traffic=session_traffic(session),
                )
            )
            pipe.close()
    return rows


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_a_controlnet_takes_a_step_cache_exact_at_0_and_bounded_above(controlnet_folders, family):
    """Serially: StepCache(0) equals the uncached pipeline; at the threshold, steps skip in the ControlNet's window
    and after it, and the latents stay within the family's bound of the uncached ones while the control (the
    residuals kept in the cache) skips the same steps and exceeds it. On 2 ranks, every strategy equals the
    serial run at 0 and at the threshold (its decisions too), each step's bytes the closed form told the skips
    (the ControlNet's layers run at a skipped step as well: its residuals are fresh)."""
    threshold, skips, bound = CONTROLNET_CASES[family]
    folder, keeps = controlnet_folders[family], Controls(cache_keeps_block_residuals=True)
    cases = [(0.0, None), (threshold, None)]
    serial = [(None, None), *cases, (threshold, keeps)]
    uncached, at_zero, cached, control = run_on_ranks(_controlnet_runs, 1, folder, family, [ParallelConfig()], serial)[
        0
    ]
    largest = uncached["latents"].abs().max().item()
    assert (at_zero["latents"] - uncached["latents"]).abs().max().item() <= 1e-4 * max(1.0, largest)
    assert not any(at_zero["skips"])
    assert cached["skips"] == control["skips"] == skips, (cached["changes"], control["changes"])
    error, control_error = (
        (run["latents"] - uncached["latents"]).abs().max().item() / largest for run in (cached, control)
    )
    assert error <= bound < control_error, (error, control_error)
    configs = [*CONTROLNET_CONFIGS, CONTROLNET_PIPEFUSION[family]]
    for rank, rows in enumerate(run_on_ranks(_controlnet_runs, 2, folder, family, configs, cases, timeout_s=400)):
        assert len(rows) == len(configs) * len(cases)
        for row in rows:
            where = f"{family} controlnet {row['config']} threshold {row['threshold']} rank {rank}"
            target = at_zero if row["threshold"] == 0 else cached
            assert row["skips"] == target["skips"], (where, row["changes"])
            assert (row["latents"] - target["latents"]).abs().max().item() <= 1e-4 * max(1.0, largest), where
            assert not traffic_mismatches(row["traffic"], where), traffic_mismatches(row["traffic"], where)
            world = [step["moved"].get("world", 0) for step in row["traffic"]]
            assert world[0] == 0 and all(world[1:]), where  # the decision, all-reduced over both ranks


# ---- torch.compile -----------------------------------------------------------------------------------------------

# each family's threshold skips every other call (the change against the last full call: Flux.2's 0.071, 0.141,
# 0.068, 0.135, 0.065; PixArt's 0.0091, about 0.018, 0.0089, ...), so both decisions are taken by the third call;
# the backend is aot_eager, the same dynamo graphs as inductor's. Measured: Flux.2 under ring 2 traces 1 graph at
# the first call (no decision yet), 18 once a call skipped and 23 once one ran after a decision, then none: the
# break splits each frame between the compiled forward and the decision (the strategy's, the model's, the block's)
COMPILED = [("flux2", ParallelConfig(ring=2), 0.1), ("pixart", ParallelConfig(ulysses=2), 0.013)]


def _compiled_beside_eager(cases):
    """On every rank: per case, the eager and the compiled model with StepCache(threshold) over the six calls; per
    call dynamo's unique graphs and recompiles so far, and whether both recorded the same collectives. The control,
    after them: one call of another size, which dynamo must recompile for (the counters can move)."""
    rows = []
    for family, config, threshold in cases:
        mesh = RankMesh(config)
        eager = parallelize(tiny_transformer(family, layers=4), config, mesh, cache=StepCache(threshold))
        compiled = parallelize(
            tiny_transformer(family, layers=4), config, mesh, cache=StepCache(threshold), compile="aot_eager"
        )
        torch._dynamo.reset()
        counters = torch._dynamo.utils.counters
        counters.clear()
        errors, graphs, recompiles, same_records = [], [], [], []
        for x in _calls(family):
            with torch.no_grad(), comm_log() as eager_log:
                expected = eager(**x).sample
            with comm_log() as compiled_log:
                output = compiled(**x).sample
            errors.append(((output - expected).abs().max() / expected.abs().max()).item())
            graphs.append(counters["stats"]["unique_graphs"])
            recompiles.append(sum(counters["recompiles"].values()))
            records = [[(r.op, r.group, r.bytes_out, r.tag) for r in log] for log in (eager_log, compiled_log)]
            same_records.append(records[0] == records[1] and len(records[0]) > 0)
        skips = (list(parallel_state(eager).cache.skips), list(parallel_state(compiled).cache.skips))
        compiled(**tiny_inputs(family, 2, height=16, width=16))  # the control: another size (the cache starts over)
        rows.append(
            dict(
                case=f"{family} {config.short()}",
                error=max(errors),
                skips=skips,
                graphs=graphs,
                recompiles=recompiles,
                same_records=same_records,
                control_recompiles=sum(counters["recompiles"].values()) + counters["stats"]["unique_graphs"],
            )
        )
    return rows


def test_a_compiled_step_cache_traces_each_decision_once():
    """Compiled equals eager (outputs, skips, the collectives recorded, the decision's all-reduce among them);
    dynamo's recompile count is fixed after the first two calls, and its graphs once both decisions were taken
    (the third call): later calls, skipping or running, reuse them."""
    for rank, rows in enumerate(run_on_ranks(_compiled_beside_eager, 2, COMPILED, timeout_s=400)):
        for row in rows:
            where = f"{row['case']} rank {rank}"
            eager_skips, compiled_skips = row["skips"]
            assert eager_skips == compiled_skips == [False, True, False, True, False, True], where
            assert row["error"] < 1e-4, where
            assert all(row["same_records"]), where
            assert row["recompiles"][2:] == [row["recompiles"][1]] * (STEPS - 2), where
            assert row["graphs"][3:] == [row["graphs"][2]] * (STEPS - 3), where
            assert row["control_recompiles"] > row["recompiles"][-1] + row["graphs"][-1], where
