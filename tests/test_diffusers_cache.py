"""diffusers' own cache configurations under parallelism, against diffusers' serial pipeline.

`load_pipeline(folder, config, cache=<diffusers cache config>)` runs diffusers' hooks after parallelize, with one
decision for every rank (xdit_lab/models/diffusers_cache.py). The reference is diffusers' stock pipeline loaded from
the same tiny folder with `transformer.enable_cache(config)`, run serially. First-Block Cache, TaylorSeer, MagCache
and PAB each equal it (1e-4 relative) under ulysses 2, ring 2 and dp 2 on tiny Flux and tiny Wan, at settings where
some steps skip and some run, with the steps skipped equal on every rank and every step's bytes equal to the closed
form; TaylorSeer and MagCache under cfg 2 with Wan's true CFG (two calls a step in diffusers); First-Block Cache and
PAB under cfg 2 with CogVideoX's CFG (one call, as ours), and refused with Wan's; ulysses x ring, FSDP2-sharded
weights and a dp stand-in row. The control: First-Block Cache deciding on each rank alone (Controls(cache_agrees=
False)) under dp 2, whose ranks hold different prompts, misses. TaylorSeer, MagCache and PAB under PipeFusion (a
hook state per patch): equal to it warmed up over every step (pf2, pf2 x dp 2, pf2 x cfg 2), within a measured bound
on stale K/V (pf2, pf2 x ulysses 2, no warm-up step), which the control (every patch on one state) exceeds.
pipe.enable_cache / disable_cache, a cache enabled by hand (refused), unparallelize, the refusals (asked without
loading a weight) and the CLI's spelling. SeaCache equals it on tiny Wan (WanPipeline hands its hooks the scheduler's
sigma; FluxPipeline does not: refused there) under ulysses 2, ring 2, dp 2 and cfg 2; its control, the indicator
from each dp rank's own sample, misses. FasterCache's attention cache (is_guidance_distilled=True) equals it under
ulysses 2, ring 2 and dp 2 on tiny Flux and Wan; its control, the CFG-Cache (refused on several ranks) with the
refusal lifted, misses diffusers' CogVideoX under cfg 2 and dp 2."""

import dataclasses

import pytest
import torch
from diffusers.hooks import (
    FasterCacheConfig,
    FirstBlockCacheConfig,
    MagCacheConfig,
    PyramidAttentionBroadcastConfig,
    SeaCacheConfig,
    TaylorSeerCacheConfig,
    TextKVCacheConfig,
)
from forward_traffic import session_traffic, traffic_mismatches

from xdit_lab import (
    LoadOptions,
    ParallelConfig,
    ParallelConfigError,
    RankMesh,
    StepCache,
    load_pipeline,
    parallelize,
    unparallelize,
)
from xdit_lab.accelerations import option_problems
from xdit_lab.families import family, recipe_for
from xdit_lab.model_folder import read_model_folder, resolve_folder
from xdit_lab.models import Controls, parallel_state
from xdit_lab.testing import run_on_ranks
from xdit_lab.tiny import save_tiny_pipeline, tiny_pipeline_kwargs

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS, STEPS = ["a red cat", "a blue dog"], 6
CONFIGS = [ParallelConfig(ulysses=2), ParallelConfig(ring=2), ParallelConfig(dp=2)]


def _methods(family):
    """name -> the configuration, each at settings where the tiny models skip at some steps and run at others.
    Wan's attention modules are attn1 and attn2, which TaylorSeer's default patterns ("^blocks.*attn") miss: its
    blocks are named instead."""
    taylorseer = dict(cache_interval=2, disable_cache_before_step=2, taylor_factors_dtype=torch.float32)
    if family == "wan":
        taylorseer["cache_identifiers"] = [r"blocks\.\d+"]
    methods = dict(
        fbc=FirstBlockCacheConfig(threshold=THRESHOLDS[family]),
        taylorseer=TaylorSeerCacheConfig(**taylorseer),
        magcache=MagCacheConfig(threshold=0.5, num_inference_steps=STEPS, mag_ratios=[1.0] + [0.9] * (STEPS - 1)),
        pab=PyramidAttentionBroadcastConfig(
            spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(0, 1000)
        ),
        # its attention cache alone (CFG-Cache, is_guidance_distilled=False, is refused on several ranks); from the
        # second step (t < 950), every other call extrapolates each attention output from the last two computed
        fastercache=FasterCacheConfig(
            spatial_attention_block_skip_range=2,
            spatial_attention_timestep_skip_range=(-1, 950),
            is_guidance_distilled=True,
        ),
    )
    if family == "wan":  # WanPipeline hands its cache context the sigma SeaCache needs (FluxPipeline does not)
        methods["seacache"] = SeaCacheConfig(threshold=SEA_THRESHOLD)
    if family == "cogvideox":  # FasterCache's CFG-Cache too, on a pipeline that batches [uncond; cond] in one call
        methods["cfgcache"] = FasterCacheConfig(
            spatial_attention_block_skip_range=2,
            spatial_attention_timestep_skip_range=(-1, 950),
            spatial_attention_block_identifiers=["transformer_blocks"],
            unconditional_batch_skip_range=2,
            unconditional_batch_timestep_skip_range=(-1, 950),
            tensor_format="BFCHW",
        )
    return methods


# between the tiny models' measured changes (serially, flux: 0.469, 0.410, 0.500 skipped, 0.567 run, 0.483 skipped;
# wan: 0.091, 0.093, 0.163 skipped, 0.190 run, 0.156 skipped; cogvideox with CFG: 0.355 skipped, 0.406 run, 0.331
# skipped, 0.405, 0.442 run), each at least 3.5% away from every change measured
# (parallel runs differ from serial by about 1e-6 relative)
THRESHOLDS = {"flux": 0.52, "wan": 0.17, "cogvideox": 0.38}
# SeaCache's spectral distances on the tiny Wan, serially (steps 1-4; 0 and 5 always run): 0.945, 0.582 run, 0.446
# skipped, then 0.446 + 0.259 run; with true CFG 0.948, 0.582, 0.447, 0.447 + 0.264: the same steps
SEA_THRESHOLD = 0.5


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {f: save_tiny_pipeline(f, tmp_path_factory.mktemp(f)) for f in ("flux", "wan", "cogvideox")}


def _call_kwargs(family, cfg):
    """Flux's pipeline has one branch; Wan's runs true CFG (two calls a step in diffusers) when `cfg`."""
    kwargs = dict(tiny_pipeline_kwargs(family), num_inference_steps=STEPS)
    if family == "cogvideox":  # its pipeline batches [uncond; cond] in one call, as xdit_lab does
        kwargs["negative_prompt"] = ["", "a photo"]
    if family == "wan":
        kwargs["guidance_scale"] = 5.0 if cfg else 1.0
        if cfg:
            kwargs["negative_prompt"] = ["", "a photo"]
    return kwargs


def _latents(output, family):
    return output.frames if family in ("wan", "cogvideox") else output.images


def _diffusers(folder, family, method, cfg=False, prompts=PROMPTS, threshold=None):
    """diffusers' pipeline with transformer.enable_cache(the method's configuration), serially: its latents (PAB
    reads the pipeline's own current_timestep, as diffusers' docs show)."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    config = _methods(family)[method]
    if threshold is not None:
        config = dataclasses.replace(config, threshold=threshold)
    if method in ("pab", "fastercache", "cfgcache"):
        config = dataclasses.replace(config, current_timestep_callback=lambda: pipe.current_timestep)
    pipe.transformer.enable_cache(config)
    output = pipe(
        prompts, generator=torch.Generator().manual_seed(0), output_type="latent", **_call_kwargs(family, cfg)
    )
    return _latents(output, family)


def _ours(folder, family, runs, cfg=False, prompts=PROMPTS):
    """On every rank: each (configuration, method, load_pipeline's other keywords) with its cache=; rows per run."""
    rows = []
    for config, method, options in runs:
        cache = _methods(family)[method]
        if "threshold" in options:  # another threshold than THRESHOLDS'
            options = dict(options)
            cache = dataclasses.replace(cache, threshold=options.pop("threshold"))
        pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False, cache=cache, **options)
        session = pipe.session(prompts, seed=0, **_call_kwargs(family, cfg)).run()
        result = session.result(output_type="latent")
        state = parallel_state(pipe.diffusers_pipeline.transformer)
        rows.append(
            dict(
                config=config.short(),
                method=method,
                latents=_latents(result, family),
                skips=result.cache_skips,
                changes=list(session.cache_changes),
                local_changes=state.cache.local_changes,
                cache_bytes=[step.get("world", 0) for step in result.comm_per_step],
                traffic=session_traffic(session),
            )
        )
        pipe.close()
    return rows


def _check(per_rank, references, measured=True):
    for rank, rows in enumerate(per_rank):
        for row, first in zip(rows, per_rank[0]):
            where = f"{row['method']} {row['config']} rank {rank}"
            expected = references[row["method"]]
            error, bound = (row["latents"] - expected).abs().max().item(), 1e-4 * max(1.0, expected.abs().max().item())
            assert error <= bound, f"{where}: {error:.3g} > {bound:.3g}"
            assert row["skips"] == first["skips"], f"{where}: the ranks skipped at other steps"
            if measured:  # settings where some steps skip and some run
                assert any(row["skips"]) and not all(row["skips"]), f"{where}: {row['skips']} (nothing measured)"
            if row["method"] == "fbc":  # two float32 all-reduced over the world at each step after the first
                assert row["cache_bytes"][0] == 0 and all(b > 0 for b in row["cache_bytes"][1:]), where
            else:  # decided from the schedule: nothing moves for the decision
                assert not any(row["cache_bytes"]), where
            # every step's bytes per group equal the closed form told the skips and the method (FSDP2's gathers,
            # "weights", have theirs in sharded_weights.py: a block is gathered before a hook decides, skipped or not)
            traffic = [
                dict(step, moved={g: n for g, n in step["moved"].items() if g != "weights"}) for step in row["traffic"]
            ]
            assert not traffic_mismatches(traffic, where), traffic_mismatches(traffic, where)


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_every_method_equals_diffusers_serial_under_ulysses_ring_dp(folders, family):
    methods = list(_methods(family))
    references = {m: _diffusers(folders[family], family, m) for m in methods}
    runs = [(config, method, {}) for config in CONFIGS for method in methods]
    _check(run_on_ranks(_ours, 2, folders[family], family, runs, timeout_s=300), references)


def test_wan_true_cfg_under_cfg2_equals_diffusers_two_calls(folders):
    """Wan's diffusers pipeline runs cond and uncond as two calls, each with its own hook state; xdit_lab runs
    [uncond; cond] as one call, split by cfg 2: TaylorSeer and MagCache (elementwise, schedule-only) equal it, and
    SeaCache, whose two contexts in diffusers see the same latents and so decide alike."""
    methods = ["taylorseer", "magcache", "seacache"]
    references = {m: _diffusers(folders["wan"], "wan", m, cfg=True) for m in methods}
    runs = [(config, m, {}) for config in (ParallelConfig(cfg=2), ParallelConfig(ulysses=2)) for m in methods]
    _check(run_on_ranks(_ours, 2, folders["wan"], "wan", runs, cfg=True, timeout_s=300), references)


def test_usp_and_sharded_weights(folders):
    """ulysses 2 x ring 2 on four ranks, and weights sharded with FSDP2 under ulysses 2 (each block gathered just
    before diffusers' hook decides whether it runs): equal to diffusers' serial run."""
    methods = ["fbc", "taylorseer"]
    references = {m: _diffusers(folders["flux"], "flux", m) for m in methods}
    usp = [(ParallelConfig(ulysses=2, ring=2), m, {}) for m in methods]
    _check(run_on_ranks(_ours, 4, folders["flux"], "flux", usp, timeout_s=400), references)
    sharded = [(ParallelConfig(ulysses=2), m, dict(shard_weights=True)) for m in methods]
    _check(run_on_ranks(_ours, 2, folders["flux"], "flux", sharded, timeout_s=300), references)


def test_cogvideox_cfg_in_one_call_takes_every_method_under_cfg2(folders):
    """CogVideoX's diffusers pipeline batches [uncond; cond] in one call, as xdit_lab does: First-Block Cache and PAB,
    refused with Wan's two calls, equal it under cfg 2 and ulysses 2 with CFG."""
    methods = ["fbc", "pab"]
    references = {m: _diffusers(folders["cogvideox"], "cogvideox", m) for m in methods}
    runs = [(config, m, {}) for config in (ParallelConfig(cfg=2), ParallelConfig(ulysses=2)) for m in methods]
    _check(run_on_ranks(_ours, 2, folders["cogvideox"], "cogvideox", runs, timeout_s=300), references)


# PipeFusion (pf2, two patches) with one warm-up step, then stale K/V: the relative L2 of the final latents against
# diffusers' serial run with the same cache configuration, measured once (torch 2.13 CPU, deterministic); each bound
# is PF_MARGIN x its figure. The control, every patch on one state (Controls(cache_state_per_patch=False)), measured
# 0.0081, 0.0169, 0.0067 on Flux and 0.46, 0.021, 0.013 on Wan: at least 8x these.
PF_STALE_L2 = {
    "flux": dict(taylorseer=7.67e-4, magcache=8.09e-4, pab=6.64e-4),
    "wan": dict(taylorseer=1.92e-3, magcache=1.78e-3, pab=1.62e-3),
}
PF_MARGIN = 1.25
# ... and with no warm-up step (each patch's state starts empty, the stale K/V zeros before a patch first ran), Flux
PF_COLD_L2 = dict(taylorseer=8.66e-4, magcache=2.62e-3, pab=1.59e-3)


def _pf2(warmup_steps):
    return ParallelConfig(pipefusion=2, num_patches=2, warmup_steps=warmup_steps)


def _relative_l2(latents, reference):
    return ((latents - reference).norm() / reference.norm()).item()


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_schedule_decided_methods_under_pipefusion(folders, family):
    """TaylorSeer, MagCache and PAB on a PipeFusion stage keep a hook state per patch, advanced once a step and cut
    from the whole image's after the warm-up (models/diffusers_cache.py). Warmed up over every step PipeFusion is
    exact: equal to diffusers' serial pipeline with the same configuration (1e-4), with the same skips on both stages
    and each step's bytes as the closed form. With one warm-up step (stale K/V after it) within PF_MARGIN x the
    measured relative L2; the control, every patch on one state, beyond it."""
    methods = ["taylorseer", "magcache", "pab"]
    references = {m: _diffusers(folders[family], family, m) for m in methods}
    control = dict(controls=Controls(cache_state_per_patch=False))
    runs = [(_pf2(STEPS), m, {}) for m in methods]
    runs += [(_pf2(1), m, {}) for m in methods] + [(_pf2(1), m, control) for m in methods]
    per_rank = run_on_ranks(_ours, 2, folders[family], family, runs, timeout_s=300)
    _check([rows[:3] for rows in per_rank], references)
    for rank, rows in enumerate(per_rank):
        for first, stale, wrong in zip(per_rank[0][3:6], rows[3:6], rows[6:]):
            method, where = stale["method"], f"{family} {stale['method']} rank {rank}"
            bound = PF_MARGIN * PF_STALE_L2[family][method]
            deviation = _relative_l2(stale["latents"], references[method])
            assert 1e-5 < deviation <= bound, f"{where}: stale {deviation:.3g}, bound {bound:.3g}"
            assert stale["skips"] == first["skips"], f"{where}: the stages skipped apart"
            assert any(stale["skips"]) and not all(stale["skips"]), f"{where}: {stale['skips']}"
            assert not traffic_mismatches(stale["traffic"], where), traffic_mismatches(stale["traffic"], where)
            missed = _relative_l2(wrong["latents"], references[method])
            assert missed > bound, f"{where}: the control {missed:.3g} within {bound:.3g}"


def test_pipefusion_without_a_warm_up_step(folders):
    """warmup_steps=0: no whole-image state to cut, so each patch's hook state starts empty at the first step, as
    diffusers' does at its first call: within PF_MARGIN x the measured relative L2, the same skips on both stages."""
    methods = ["taylorseer", "magcache", "pab"]
    references = {m: _diffusers(folders["flux"], "flux", m) for m in methods}
    per_rank = run_on_ranks(_ours, 2, folders["flux"], "flux", [(_pf2(0), m, {}) for m in methods], timeout_s=300)
    for rank, rows in enumerate(per_rank):
        for first, row in zip(per_rank[0], rows):
            where, bound = f"flux {row['method']} rank {rank}", PF_MARGIN * PF_COLD_L2[row["method"]]
            deviation = _relative_l2(row["latents"], references[row["method"]])
            assert 1e-5 < deviation <= bound, f"{where}: {deviation:.3g}, bound {bound:.3g}"
            assert row["skips"] == first["skips"] and any(row["skips"]), f"{where}: {row['skips']}"
            assert not traffic_mismatches(row["traffic"], where), traffic_mismatches(row["traffic"], where)


def test_pipefusion_with_dp_ulysses_and_true_cfg_on_four_ranks(folders):
    """pf2 x dp 2 warmed up over every step equals diffusers' serial Flux, and pf2 x cfg 2 Wan's with true CFG (two
    calls a step in diffusers, one state per branch); pf2 x ulysses 2 past one warm-up step cuts each patch's state
    from the tokens each sp rank holds of it, within the pf2 bound (the same stale attention, on Wan: tiny Flux's
    text is as long as a rank's image there, which is refused by name)."""
    flux = {"taylorseer": _diffusers(folders["flux"], "flux", "taylorseer")}
    runs = [(dataclasses.replace(_pf2(STEPS), dp=2), "taylorseer", {})]
    _check(run_on_ranks(_ours, 4, folders["flux"], "flux", runs, timeout_s=400), flux)
    wan = {m: _diffusers(folders["wan"], "wan", m, cfg=True) for m in ("taylorseer", "magcache")}
    runs = [(dataclasses.replace(_pf2(STEPS), cfg=2), m, {}) for m in wan]
    _check(run_on_ranks(_ours, 4, folders["wan"], "wan", runs, cfg=True, timeout_s=400), wan)
    wan = {m: _diffusers(folders["wan"], "wan", m) for m in ("magcache", "pab")}
    runs = [(dataclasses.replace(_pf2(1), ulysses=2), m, {}) for m in wan]
    for rank, rows in enumerate(run_on_ranks(_ours, 4, folders["wan"], "wan", runs, timeout_s=400)):
        for row in rows:
            where, bound = (
                f"wan {row['method']} {row['config']} rank {rank}",
                PF_MARGIN * PF_STALE_L2["wan"][row["method"]],
            )
            deviation = _relative_l2(row["latents"], wan[row["method"]])
            assert 1e-5 < deviation <= bound, f"{where}: stale {deviation:.3g}, bound {bound:.3g}"
            assert not traffic_mismatches(row["traffic"], where), traffic_mismatches(row["traffic"], where)


def _hooks_outside_the_blocks():
    """On every rank: a tiny Flux transformer parallelized under pf2 with TaylorSeer on proj_out; what it says."""
    from xdit_lab.tiny import tiny_transformer

    config = _pf2(1)
    try:
        parallelize(
            tiny_transformer("flux"),
            config,
            mesh=RankMesh(config),
            cache=TaylorSeerCacheConfig(cache_identifiers=[r"transformer_blocks\.0\.attn", "proj_out"]),
        )
    except ParallelConfigError as error:
        return str(error)


def test_pipefusion_refuses_hooks_outside_the_blocks():
    """A stage keeps a hook state per patch of its blocks' tokens; proj_out runs over the whole image: refused by
    name at parallelize, on every rank (use_lite_mode, which hooks it, before a weight is read: test above)."""
    for said in run_on_ranks(_hooks_outside_the_blocks, 2, timeout_s=120):
        assert said and "hooks proj_out, outside the blocks" in said, said


def _with_true_cfg(folder, method):
    """On every rank: Wan with true CFG under cfg 2 and the method's cache; the refusal said at the first step."""
    config = ParallelConfig(cfg=2)
    pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False, cache=_methods("wan")[method])
    try:
        pipe.session(PROMPTS, seed=0, **_call_kwargs("wan", cfg=True)).run()
        return None
    except ParallelConfigError as error:
        return str(error)
    finally:
        pipe.close()


@pytest.mark.parametrize("method", ["fbc", "pab", "fastercache"])
def test_wan_true_cfg_refuses_what_decides_per_branch(folders, method):
    """First-Block Cache decides from each branch's residual and PAB and FasterCache advance per call in diffusers'
    two calls a step; one call over [uncond; cond] would decide otherwise: refused by name at the first step, on
    every rank."""
    for said in run_on_ranks(_with_true_cfg, 2, folders["wan"], method, timeout_s=300):
        assert said and "with true CFG: diffusers' pipeline runs the two branches as two calls" in said, said


def test_control_first_block_cache_decided_per_rank_misses(folders):
    """CONTROL, deliberately wrong: First-Block Cache with each dp rank deciding from its own prompt's residual
    (Controls(cache_agrees=False), as diffusers' hooks decide on each rank): the ranks skip at other steps, and the
    latents miss diffusers' serial result, which the agreed run equals. The threshold lies between the two ranks'
    own changes at the second step (measured 0.4636 and 0.4734; together 0.4687, which runs the blocks)."""
    family, config, threshold = "flux", ParallelConfig(dp=2), 0.466
    reference = _diffusers(folders[family], family, "fbc", threshold=threshold)
    agreed = dict(threshold=threshold)
    runs = [(config, "fbc", agreed), (config, "fbc", dict(agreed, controls=Controls(cache_agrees=False)))]
    per_rank = run_on_ranks(_ours, 2, folders[family], family, runs, timeout_s=300)
    _check([rows[:1] for rows in per_rank], {"fbc": reference}, measured=False)
    alone = [rows[1] for rows in per_rank]
    assert alone[0]["skips"] != alone[1]["skips"], [row["local_changes"] for row in alone]
    bound = 1e-4 * max(1.0, reference.abs().max().item())
    assert (alone[0]["latents"] - reference).abs().max().item() > bound


def test_control_sea_cache_indicator_per_rank_misses(folders):
    """CONTROL, deliberately wrong: SeaCache's spectral indicator from each dp rank's own sample (Controls(
    cache_agrees=False): as if its hook ran after the batch was split), where diffusers' hook on the transformer reads
    the whole batch, on every rank alike (so the agreed run moves nothing for it). The threshold lies between the two
    prompts' own distances at step 4 (measured 0.2536 and 0.2647; together 0.2592, which runs the blocks): the first
    rank alone skips there, and the latents miss diffusers' serial result, which the agreed run equals."""
    config, threshold = ParallelConfig(dp=2), 0.257
    reference = _diffusers(folders["wan"], "wan", "seacache", threshold=threshold)
    agreed = dict(threshold=threshold)
    runs = [(config, "seacache", agreed), (config, "seacache", dict(agreed, controls=Controls(cache_agrees=False)))]
    per_rank = run_on_ranks(_ours, 2, folders["wan"], "wan", runs, timeout_s=300)
    _check([rows[:1] for rows in per_rank], {"seacache": reference}, measured=False)
    alone = [rows[1] for rows in per_rank]
    assert alone[0]["skips"] == [False] * 4 + [True, False] and not any(alone[1]["skips"]), alone
    bound = 1e-4 * max(1.0, reference.abs().max().item())
    assert (alone[0]["latents"] - reference).abs().max().item() > bound


def _with_refusal_lifted(folder, configs):
    """On every rank: CogVideoX with FasterCache's CFG-Cache under each configuration, its refusal lifted (this
    rank's process only): the latents, or the error raised."""
    import xdit_lab.load_options
    import xdit_lab.models.diffusers_cache
    import xdit_lab.models.parallel

    for module in (xdit_lab.load_options, xdit_lab.models.diffusers_cache, xdit_lab.models.parallel):
        module.option_problems = lambda *args, **kwargs: []
    return [row["latents"] for row in _ours(folder, "cogvideox", [(config, "cfgcache", {}) for config in configs])]


def test_control_faster_cache_cfg_cache_on_cfg_and_dp_shares_misses(folders):
    """CONTROL, deliberately wrong: FasterCache's CFG-Cache (is_guidance_distilled=False) with its refusal lifted.
    Its hook on the transformer halves the whole [uncond; cond] batch, but its attention hooks see a cfg or dp
    rank's share and take the second half of those rows as the conditional branch: under cfg 2 and dp 2 the latents
    miss diffusers' serial CogVideoX (one call a step, as ours). (Under ulysses 2, measured once by hand, they equal
    it, but the halved calls move half the bytes the closed form counts: refused there too.)"""
    reference = _diffusers(folders["cogvideox"], "cogvideox", "cfgcache")
    configs = [ParallelConfig(cfg=2), ParallelConfig(dp=2)]
    bound = 1e-4 * max(1.0, reference.abs().max().item())
    for rank, rows in enumerate(run_on_ranks(_with_refusal_lifted, 2, folders["cogvideox"], configs, timeout_s=300)):
        for config, latents in zip(configs, rows):
            assert (latents - reference).abs().max().item() > bound, f"{config.short()} rank {rank}"


def test_dp_stand_in_rows_add_nothing_to_the_decision(folders):
    """Two prompts on dp 3: the third group computes a stand-in copy of the last row, then drops it; counted in
    First-Block Cache's sums it would weigh that prompt twice. The skipped steps and latents equal diffusers'.
    (Counted, the latents missed diffusers' by 0.029 against a bound of 4.1e-4, measured once by hand.)"""
    reference = _diffusers(folders["flux"], "flux", "fbc")
    runs = [(ParallelConfig(dp=3), "fbc", {})]
    _check(run_on_ranks(_ours, 3, folders["flux"], "flux", runs, timeout_s=300), {"fbc": reference})


def _enable_by_hand(folder):
    """On every rank: pipe.enable_cache / disable_cache, then transformer.enable_cache by hand, refused."""
    config = ParallelConfig(ulysses=2)
    pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False)
    kwargs = _call_kwargs("flux", False)
    plain = _latents(pipe.session(PROMPTS, seed=0, **kwargs).run().result(output_type="latent"), "flux")
    pipe.enable_cache(_methods("flux")["fbc"])
    cached = pipe.session(PROMPTS, seed=0, **kwargs).run().result(output_type="latent")
    pipe.disable_cache()
    again = _latents(pipe.session(PROMPTS, seed=0, **kwargs).run().result(output_type="latent"), "flux")
    transformer = pipe.diffusers_pipeline.transformer
    transformer.enable_cache(FirstBlockCacheConfig(threshold=0.5))
    try:
        pipe.session(PROMPTS, seed=0, **kwargs).run()
        refused = None
    except ParallelConfigError as error:
        refused = str(error)
    transformer.disable_cache()
    pipe.enable_cache(_methods("flux")["fbc"])
    unparallelize(transformer)  # diffusers' hooks go with ours
    left = [name for m in transformer.modules() for name in getattr(getattr(m, "_diffusers_hook", None), "hooks", {})]
    pipe.close()
    return dict(
        plain=plain,
        cached=_latents(cached, "flux"),
        skips=cached.cache_skips,
        again=again,
        refused=refused,
        left=left,
        enabled=transformer.is_cache_enabled,
    )


def test_pipe_enable_cache_and_a_cache_enabled_by_hand(folders):
    reference = _diffusers(folders["flux"], "flux", "fbc")
    for rank, row in enumerate(run_on_ranks(_enable_by_hand, 2, folders["flux"], timeout_s=300)):
        assert (row["cached"] - reference).abs().max().item() <= 1e-4 * max(1.0, reference.abs().max().item()), rank
        assert any(row["skips"]), rank
        assert torch.equal(row["again"], row["plain"]), f"rank {rank}: disable_cache left something behind"
        assert row["refused"] and "enabled by hand (transformer.enable_cache)" in row["refused"], row["refused"]
        assert row["left"] == [] and not row["enabled"], f"rank {rank}: unparallelize left {row['left']}"


def test_refused_by_name_before_a_weight_is_read(tmp_path, folders):
    flux = family("flux").ADAPTER
    ulysses = ParallelConfig(ulysses=2)

    def said(cache, config=ulysses, adapter=flux, **options):
        return "; ".join(sentence for sentence, _ in option_problems(config, adapter, cache=cache, **options))

    # FasterCache's CFG-Cache takes the rows its hooks see as [uncond; cond]: refused on several ranks
    assert "runs its CFG-Cache" in said(FasterCacheConfig())
    assert said(FasterCacheConfig(), ParallelConfig()) == ""
    assert "leave current_timestep_callback None" in said(
        FasterCacheConfig(is_guidance_distilled=True, current_timestep_callback=lambda: 0)
    )
    # SeaCache reads the scheduler's sigma from the cache context, which FluxPipeline does not open with one (its
    # hooks run every block in diffusers' own run): refused there; on Wan refused under tp, with FSDP2-sharded
    # weights (diffusers' hook runs every parameter-sharded block) and with WanImageToVideoPipeline (no sigma)
    assert "without the scheduler's sigma" in said(SeaCacheConfig())
    wan = family("wan").ADAPTER
    assert said(SeaCacheConfig(), adapter=wan) == ""
    assert "does not run under tp" in said(SeaCacheConfig(), ParallelConfig(tp=2), adapter=wan)
    wan_folder = read_model_folder(resolve_folder(folders["wan"]))
    for options, pipeline_class, refusal in (
        (dict(shard_weights=True), "WanPipeline", "does not take shard_weights=True"),
        (dict(pipeline_class="WanImageToVideoPipeline"), "WanImageToVideoPipeline", "does not run with WanImageTo"),
    ):
        problems = LoadOptions(cache=SeaCacheConfig(), **options).problems(
            recipe_for(pipeline_class), wan_folder, ulysses
        )
        assert refusal in "; ".join(map(str, problems)), problems
    assert "NucleusMoE-Image" in said(TextKVCacheConfig())
    pf2 = ParallelConfig(pipefusion=2)
    assert "stage 0 would decide per patch" in said(FirstBlockCacheConfig(), pf2)
    for method in ("taylorseer", "magcache", "pab"):  # a state per patch (test_schedule_decided_methods_under_...)
        assert said(_methods("flux")[method], pf2) == "", method
        async_pf2 = ParallelConfig(pipefusion=2, pipefusion_schedule="async")
        assert "does not run under pipefusion_schedule='async'" in said(_methods("flux")[method], async_pf2)
    assert "use_lite_mode=True) does not run under PipeFusion" in said(TaylorSeerCacheConfig(use_lite_mode=True), pf2)
    for cache in (FasterCacheConfig(is_guidance_distilled=True), SeaCacheConfig()):  # hooks on the transformer
        assert "hooks the transformer itself" in said(cache, pf2, adapter=family("wan").ADAPTER), cache
    assert "compile=True does not take diffusers' FirstBlockCacheConfig" in said(FirstBlockCacheConfig(), compile=True)
    assert "calibrate on one rank" in said(MagCacheConfig(calibrate=True))
    assert said(MagCacheConfig(calibrate=True), ParallelConfig()) == ""  # one rank measures the whole
    assert "leave current_timestep_callback None" in said(
        PyramidAttentionBroadcastConfig(current_timestep_callback=lambda: 0)
    )
    for cache in _methods("flux").values():
        assert said(cache) == "", cache
    # where diffusers' own hooks raise serially: refused by name (the rest of those families' methods run)
    flux2, hunyuanvideo15 = family("flux2").ADAPTER, family("hunyuanvideo15").ADAPTER
    assert "subtracts one from the other" in said(FirstBlockCacheConfig(), adapter=flux2)
    assert said(_methods("flux")["magcache"], adapter=flux2) == ""
    for cache in (FirstBlockCacheConfig(), _methods("flux")["magcache"]):
        assert "TransformerBlockRegistry does not list" in said(cache, adapter=hunyuanvideo15)
    assert said(_methods("flux")["taylorseer"], adapter=hunyuanvideo15) == ""
    # a family whose transformer has no CacheMixin: refused through LoadOptions, before a weight is read
    folder = read_model_folder(resolve_folder(save_tiny_pipeline("pixart", tmp_path)))
    problems = LoadOptions(cache=FirstBlockCacheConfig()).problems(recipe_for(folder.pipeline_class), folder, ulysses)
    assert "PixArtTransformer2DModel takes no diffusers cache (it has no CacheMixin" in "; ".join(map(str, problems))
    # an object cache= does not know, even one with a threshold
    unknown = option_problems(ulysses, flux, cache=dataclasses.make_dataclass("Mine", [("threshold", float)])(0.1))
    assert unknown[0][1] is TypeError and "is not a cache xdit_lab runs" in unknown[0][0]
    assert option_problems(ulysses, flux, cache=StepCache(0.1)) == []
    # diffusers' cache enabled by hand before parallelize would decide per rank: refused before anything is set up
    from xdit_lab.tiny import tiny_transformer

    transformer = tiny_transformer("flux")
    transformer.enable_cache(FirstBlockCacheConfig())
    with pytest.raises(ParallelConfigError, match=r"enabled by hand \(transformer.enable_cache\)"):
        parallelize(transformer, ParallelConfig())


def test_the_cli_loads_what_it_names(folders):
    """`xdit-lab run FOLDER --cache taylorseer:...` loads with that configuration as cache= (the runs above), kept in
    the report by its class; `--cache stepcache:threshold=0.1` is our StepCache, as the Python call writes it.
    (In process: torchrun's ranks
    would add fresh interpreters to make test's budget; tests/test_step_cache.py runs the CLI with a cache.)"""
    from xdit_lab.cli import _build_parser, load_options_of

    spec = "taylorseer:cache_interval=2,disable_cache_before_step=2,taylor_factors_dtype=float32"
    run = ["run", "--model", str(folders["flux"]), "--output", "unused", "--prompt", "a red cat"]
    options = load_options_of(_build_parser().parse_args([*run, "--cache", spec]))
    assert options.cache == _methods("flux")["taylorseer"]
    assert options.to_record()["cache"]["diffusers"] == "TaylorSeerCacheConfig"
    assert load_options_of(_build_parser().parse_args([*run, "--cache", "stepcache:threshold=0.1"])).cache == StepCache(
        0.1
    )
    with pytest.raises(SystemExit):  # one spelling: the threshold flag of old is gone
        _build_parser().parse_args([*run, "--cache-threshold", "0.1"])


def test_the_cli_spelling():
    """xdit-lab run --cache NAME:KEY=VALUE,...: diffusers' configuration of that name, its values read as JSON."""
    import argparse

    from xdit_lab.cli import _cache

    assert _cache("fbc:threshold=0.2") == FirstBlockCacheConfig(threshold=0.2)
    assert _cache("taylorseer:cache_interval=4") == TaylorSeerCacheConfig(cache_interval=4)
    assert _cache("seacache:threshold=0.5") == SeaCacheConfig(threshold=0.5)
    assert _cache("fastercache:is_guidance_distilled=true") == FasterCacheConfig(is_guidance_distilled=True)
    taylorseer = _cache("taylorseer:taylor_factors_dtype=float32")
    assert taylorseer.taylor_factors_dtype is torch.float32
    mag = _cache("magcache:mag_ratios=[1.0,0.9,0.8],num_inference_steps=3")
    assert mag.mag_ratios.tolist() == pytest.approx([1.0, 0.9, 0.8]) and mag.num_inference_steps == 3
    pab = _cache("pab:spatial_attention_block_skip_range=2,spatial_attention_timestep_skip_range=[0,1000]")
    assert pab.spatial_attention_timestep_skip_range == [0, 1000]
    for wrong in ("nocache:threshold=0.1", "fbc:threshold", "fbc:thresh=0.1", "taylorseer:taylor_factors_dtype=f3"):
        with pytest.raises(argparse.ArgumentTypeError):
            _cache(wrong)
