"""StepCache against diffusers' own First-Block Cache, run serially, under every strategy.

The reference is diffusers' `apply_first_block_cache` on the stock pipeline loaded from the same
tiny folder. At threshold 0 nothing is skipped and the serial run equals diffusers without a cache
(every strategy without a cache equals diffusers: tests/test_pipelines.py); at a threshold where
some steps skip and some run, the steps skipped and the latents of every strategy equal diffusers'
(1e-4 relative). The steps diffusers skipped are read from the reference itself: a step whose last
block's attention never ran was skipped. Every run above one rank also shows its traffic: each step's
bytes per group equal the closed form told the skips (xdit_lab.traffic.expected_bytes_per_step).

diffusers' hooks need a cache context that only some pipelines open; for PixArt the context is
opened here by hand. (For SD3 diffusers' hooks fail: its last block returns no text, shown in
test_sd3_skips_agree_across_strategies, which compares with our own serial run instead.)"""

import pytest
import torch
from forward_traffic import session_traffic, traffic_mismatches, traffic_row

from xdit_lab import ParallelConfig, ParallelConfigError, RankMesh, StepCache, load_pipeline
from xdit_lab.models import Controls, parallel_state
from xdit_lab.testing import RankFailure, run_on_ranks
from xdit_lab.tiny import save_tiny_pipeline, tiny_pipeline_kwargs

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS, NEGATIVES, STEPS = ["a red cat", "a blue dog"], ["", "a photo"], 6
# thresholds between the tiny models' measured changes, each at least 0.5% away from every change
# measured (parallel runs differ from serial by about 1e-6 relative)
THRESHOLDS = {"pixart": 0.3, "flux": 0.48, "cogvideox": 0.3, "sd3": 0.4, "qwenimage": 0.58, "hunyuanvideo": 0.3}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    families = ("pixart", "flux", "cogvideox", "sd3", "qwenimage", "hunyuanvideo")
    return {f: save_tiny_pipeline(f, tmp_path_factory.mktemp(f)) for f in families}


def _call_kwargs(family):
    kwargs = dict(tiny_pipeline_kwargs(family), num_inference_steps=STEPS)
    if family not in ("flux", "qwenimage", "hunyuanvideo"):  # true CFG: two transformer calls a step, two caches
        kwargs["negative_prompt"] = NEGATIVES
    return kwargs


def _latents(output, family):
    return output.frames if family in ("cogvideox", "hunyuanvideo") else output.images


def _diffusers_first_block_cache(folder, family, threshold, prompts=PROMPTS):
    """diffusers' pipeline with its First-Block Cache: (latents, skipped per step)."""
    from diffusers import DiffusionPipeline
    from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache
    from diffusers.hooks.hooks import CacheContext, _set_cache_context

    pipe = DiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    transformer = pipe.transformer
    if threshold is not None:
        apply_first_block_cache(transformer, FirstBlockCacheConfig(threshold=threshold))
        if family == "pixart":  # its pipeline opens no cache context
            _set_cache_context(transformer, CacheContext("all"))
    blocks = [b for name in ("transformer_blocks", "single_transformer_blocks") for b in getattr(transformer, name, [])]
    ran = _skips_recorded(transformer, blocks)
    kwargs = _call_kwargs(family)
    if "negative_prompt" in kwargs:
        kwargs["negative_prompt"] = kwargs["negative_prompt"][: len(prompts)]
    output = pipe(prompts, generator=torch.Generator().manual_seed(0), output_type="latent", **kwargs)
    return _latents(output, family), [not r for r in ran]


class _StandInCounted:
    """CONTROL, deliberately wrong: the rank's ParallelState as a StepCache sees it, with a dp stand-in row
    (computed by a group without samples of its own, then dropped) counted in the cache's sums as if it
    were a sample. Everything else is the state's own."""

    stand_in = False

    def __init__(self, state):
        self._state = state

    def __getattr__(self, name):
        return getattr(self._state, name)


_REFERENCES = {}


def _reference(folder, family, threshold, prompts=PROMPTS):
    """diffusers' First-Block Cache run serially, once per case in the test process (not once per rank
    and world size) and kept for the module: (latents, skipped per step). Threshold 0: no cache."""
    key = (str(folder), family, threshold, tuple(prompts))
    if key not in _REFERENCES:
        _REFERENCES[key] = _diffusers_first_block_cache(folder, family, threshold or None, prompts)
    return _REFERENCES[key]


def _against_diffusers(folder, family, configs, threshold, reference, prompts=PROMPTS, controls=()):
    """On every rank: each configuration with StepCache(threshold) against `reference`, diffusers' run
    (_reference); then each of `controls` with the cache counting dp stand-in rows (_StandInCounted),
    in the same spawn (its rows follow the configurations')."""
    expected, expected_skips = reference
    kwargs = _call_kwargs(family)
    if "negative_prompt" in kwargs:
        kwargs["negative_prompt"] = kwargs["negative_prompt"][: len(prompts)]
    rows = []
    for config, control in [(c, False) for c in configs] + [(c, True) for c in controls]:
        pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False, cache=StepCache(threshold))
        if control:
            cache = parallel_state(pipe.diffusers_pipeline.transformer).cache
            cache.state = _StandInCounted(cache.state)
        session = pipe.session(prompts, seed=0, **kwargs).run()
        result = session.result(output_type="latent")
        latents = _latents(result, family)
        rows.append(
            dict(
                config=config.short(),
                error=(latents - expected).abs().max().item(),
                bound=1e-4 * max(1.0, expected.abs().max().item()),
                skips=result.cache_skips,
                expected_skips=expected_skips,
                changes=list(session.cache_changes),
                cache_bytes=[step.get("world", 0) for step in result.comm_per_step],
                traffic=session_traffic(session),
            )
        )
        pipe.close()
    return rows


def _check(per_rank, configs, family, skipping):
    for rank, rows in enumerate(per_rank):
        for row, config in zip(rows, configs):
            where = f"{family} {row['config']} rank {rank}"
            assert row["error"] <= row["bound"], f"{where}: {row['error']:.3g} > {row['bound']:.3g}"
            assert row["skips"] == row["expected_skips"], where
            assert row["skips"] == per_rank[0][configs.index(config)]["skips"], f"{where}: ranks disagree"
            assert any(row["skips"]) == skipping, where
            # every step's bytes per group equal the closed form told the skips, and it has every degree move
            assert not traffic_mismatches(row["traffic"], where), traffic_mismatches(row["traffic"], where)
            degrees = {g for g in ("ulysses", "ring", "cfg", "dp", "pipefusion") if getattr(config, g) > 1}
            assert degrees <= {g for step in row["traffic"] for g in step["moved"]}, where
            if config.world_size > 1:  # one all-reduce of two float32 per step after the first
                assert row["cache_bytes"][0] == 0 and all(b > 0 for b in row["cache_bytes"][1:]), where


PIXART_2 = [
    ParallelConfig(ulysses=2),
    ParallelConfig(ring=2),
    ParallelConfig(cfg=2),
    ParallelConfig(dp=2),
    ParallelConfig(pipefusion=2, warmup_steps=STEPS),
    ParallelConfig(pipefusion=2, num_patches=4, warmup_steps=STEPS),
]
PIXART_4 = [
    ParallelConfig(ulysses=2, ring=2),
    ParallelConfig(cfg=2, ulysses=2),
    ParallelConfig(dp=2, ring=2),
    ParallelConfig(pipefusion=2, ulysses=2, warmup_steps=STEPS),
    ParallelConfig(pipefusion=2, ring=2, warmup_steps=STEPS),
    ParallelConfig(pipefusion=2, cfg=2, warmup_steps=STEPS),
    ParallelConfig(pipefusion=2, dp=2, warmup_steps=STEPS),
]


def test_threshold_zero_skips_nothing_and_equals_diffusers_without_a_cache(folders):
    """StepCache(0): every step runs, and the serial latents equal diffusers' pipeline without a cache.
    (Every strategy without a cache equals it too: tests/test_pipelines.py; with a cache that skips, below.)"""
    reference = _reference(folders["pixart"], "pixart", 0.0)
    per_rank = run_on_ranks(_against_diffusers, 1, folders["pixart"], "pixart", [ParallelConfig()], 0.0, reference)
    _check(per_rank, [ParallelConfig()], "pixart", skipping=False)


def test_pixart_every_strategy_equals_diffusers_first_block_cache(folders):
    threshold = THRESHOLDS["pixart"]
    reference = _reference(folders["pixart"], "pixart", threshold)
    for world_size, configs in ((1, [ParallelConfig()]), (2, PIXART_2)):
        per_rank = run_on_ranks(
            _against_diffusers, world_size, folders["pixart"], "pixart", configs, threshold, reference, timeout_s=300
        )
        _check(per_rank, configs, "pixart", skipping=True)


def test_dp_stand_in_rows_do_not_count_in_the_decision(folders):
    """One prompt with CFG is a batch of two rows [uncond; cond]; dp 3 gives them to two groups, and
    the third computes a stand-in copy of the last row. Counted in the sums, it would weigh the
    conditional row twice and move the decision; the skipped steps and latents equal diffusers'.
    Threshold 0.13 lies between the change at step 3 without the stand-in (measured 0.128) and with it
    (0.131): the control, a cache that counts the stand-in row (_StandInCounted), is run on the same
    ranks and takes another decision than diffusers at that step."""
    configs, threshold = [ParallelConfig(dp=3)], 0.13
    folder, prompts = folders["pixart"], ["a red cat"]
    reference = _reference(folder, "pixart", threshold, prompts)
    runs = run_on_ranks(_against_diffusers, 3, folder, "pixart", configs, threshold, reference, prompts, configs)
    _check([rows[:1] for rows in runs], configs, "pixart", skipping=True)
    for rank, (right, counted) in enumerate(runs):
        assert counted["skips"] != counted["expected_skips"], f"rank {rank}: the control skips as diffusers does"
        step = next(i for i, (a, b) in enumerate(zip(counted["skips"], right["skips"])) if a != b)
        assert right["changes"][step] < threshold < counted["changes"][step], (right["changes"], counted["changes"])


def test_pixart_hybrids_on_4_ranks_equal_diffusers_first_block_cache(folders):
    threshold = THRESHOLDS["pixart"]
    reference = _reference(folders["pixart"], "pixart", threshold)
    per_rank = run_on_ranks(
        _against_diffusers, 4, folders["pixart"], "pixart", PIXART_4, threshold, reference, timeout_s=400
    )
    _check(per_rank, PIXART_4, "pixart", skipping=True)


@pytest.mark.parametrize("family", ["flux", "cogvideox", "qwenimage", "hunyuanvideo"])
def test_joint_families_equal_diffusers_first_block_cache(folders, family):
    """Flux, Qwen-Image and HunyuanVideo run without true CFG here (their diffusers pipelines call the
    transformer once per branch, each with its own cache); CogVideoX with CFG, so cfg 2 splits it."""
    uses_cfg = family == "cogvideox"
    configs = {
        2: [ParallelConfig(ulysses=2), ParallelConfig(ring=2), ParallelConfig(dp=2)]
        + ([ParallelConfig(cfg=2)] if uses_cfg else [])
        + [ParallelConfig(pipefusion=2, num_patches=4, warmup_steps=STEPS)],  # text handed over per patch
        4: [
            ParallelConfig(ulysses=2, ring=2),
            ParallelConfig(cfg=2, ulysses=2) if uses_cfg else ParallelConfig(dp=2, ulysses=2),
        ],
    }
    for world_size in (2, 4):
        runs = run_on_ranks(
            _against_diffusers,
            world_size,
            folders[family],
            family,
            configs[world_size],
            THRESHOLDS[family],
            _reference(folders[family], family, THRESHOLDS[family]),
            timeout_s=400,
        )
        _check(runs, configs[world_size], family, skipping=True)


def _ours(folder, family, configs, threshold):
    rows = []
    for config in configs:
        pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False, cache=StepCache(threshold))
        session = pipe.session(PROMPTS, seed=0, **_call_kwargs(family)).run()
        result = session.result(output_type="latent")
        rows.append(
            dict(
                config=config.short(),
                latents=_latents(result, family),
                skips=result.cache_skips,
                traffic=session_traffic(session),
            )
        )
        pipe.close()
    return rows


def _diffusers_refuses_sd3(folder):
    try:
        _diffusers_first_block_cache(folder, "sd3", THRESHOLDS["sd3"])
    except Exception as error:  # whatever diffusers raises: the test reads its type and message
        return f"{type(error).__name__}: {error}"
    return None


def test_sd3_skips_agree_across_strategies(folders):
    """SD3 has no reference from diffusers: its First-Block Cache raises on SD3 (the last block returns no
    text to take a residual of; run here, so that a diffusers that learns to do it shows up as a failure
    of this test, and SD3 then joins the families compared with diffusers). The reference is therefore
    our own serial StepCache, which the families above show equal to diffusers' where diffusers runs:
    at a threshold that skips some steps, every strategy (USP and cfg 2 × ulysses 2 on 4 ranks too)
    skips the steps the serial run skips, with latents within 1e-4 of it, and each step's bytes equal
    the closed form told the skips. (Without skipping, SD3 equals diffusers: tests/test_pipelines.py.)"""
    refused = _diffusers_refuses_sd3(folders["sd3"])
    assert refused is not None, "diffusers' First-Block Cache now runs on SD3: compare with it (_against_diffusers)"
    configs = [
        ParallelConfig(ulysses=2),
        ParallelConfig(ring=2),
        ParallelConfig(cfg=2),
        ParallelConfig(dp=2),
        ParallelConfig(pipefusion=2, num_patches=4, warmup_steps=STEPS),
    ]
    (serial,) = run_on_ranks(_ours, 1, folders["sd3"], "sd3", [ParallelConfig()], THRESHOLDS["sd3"])
    assert any(serial[0]["skips"]) and not all(serial[0]["skips"][1:])
    reference = serial[0]["latents"]
    usp = [ParallelConfig(ulysses=2, ring=2), ParallelConfig(cfg=2, ulysses=2)]
    for world_size, group in ((2, configs), (4, usp)):
        for rank, rows in enumerate(_ours_on(world_size, folders["sd3"], group)):
            for row in rows:
                where = f"{row['config']} rank {rank}"
                assert row["skips"] == serial[0]["skips"], where
                error = (row["latents"] - reference).abs().max().item()
                assert error <= 1e-4 * max(1.0, reference.abs().max().item()), f"{where}: {error:.3g}"
                assert not traffic_mismatches(row["traffic"], where), traffic_mismatches(row["traffic"], where)


def _ours_on(world_size, folder, configs):
    return run_on_ranks(_ours, world_size, folder, "sd3", configs, THRESHOLDS["sd3"], timeout_s=300)


def _skips_recorded(transformer, blocks: list) -> list[bool]:
    """A list that gains an entry per call of `transformer`: whether its last block's attention ran (a
    step whose last block never ran was skipped)."""
    ran = []
    transformer.register_forward_pre_hook(lambda *_: ran.append(False))
    last = blocks[-1]
    attention = getattr(last, "attn", None) or last.attn1
    attention.register_forward_pre_hook(lambda *_: ran.__setitem__(-1, True))
    return ran


def _transformer_calls(family, configs, threshold):
    """DiT and Wan have no pipeline here: six transformer calls on a slowly changing latent, as steps are.
    diffusers' First-Block Cache on the serial model is the reference for the outputs and the skips."""
    from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache
    from diffusers.hooks.hooks import CacheContext, _set_cache_context

    from xdit_lab import comm_log, parallelize
    from xdit_lab.families import adapter_for
    from xdit_lab.tiny import tiny_inputs, tiny_transformer

    base = tiny_inputs(family, 2, height=8, width=8)
    noise = torch.randn(base["hidden_states"].shape, generator=torch.Generator().manual_seed(3))
    calls = [dict(base, hidden_states=base["hidden_states"] + 0.05 * i * noise) for i in range(STEPS)]
    reference = tiny_transformer(family, layers=4)
    apply_first_block_cache(reference, FirstBlockCacheConfig(threshold=threshold))
    _set_cache_context(reference, CacheContext("all"))
    ran = _skips_recorded(reference, adapter_for(reference).blocks(reference))
    with torch.no_grad():
        expected = [reference(**x).sample for x in calls]
    rows = []
    for config in configs:
        model = parallelize(tiny_transformer(family, layers=4), config, RankMesh(config), cache=StepCache(threshold))
        outs, traffic = [], []
        with torch.no_grad():
            for step, x in enumerate(calls):
                with comm_log() as log:
                    outs.append(model(**x).sample)
                traffic.append(traffic_row(model, x, log, step))
        error = max((o - e).abs().max().item() for o, e in zip(outs, expected))
        rows.append(dict(config=config.short(), error=error, skips=parallel_state(model).cache.skips, traffic=traffic))
    return rows, max(e.abs().max().item() for e in expected), [not r for r in ran]


@pytest.mark.parametrize("family", ["dit", "wan"])  # Flux.2: tests/test_step_cache_flux2_controlnet_compile.py
def test_transformer_without_recipe_equals_diffusers_first_block_cache(family):
    """Six calls of the transformer alone under each strategy: the outputs and the steps skipped equal
    diffusers' First-Block Cache on the serial model's, and each call's bytes equal the closed form."""
    configs = [ParallelConfig(ulysses=2), ParallelConfig(ring=2), ParallelConfig(cfg=2), ParallelConfig(dp=2)]
    if family == "dit":
        configs.append(ParallelConfig(pipefusion=2, warmup_steps=STEPS))
    per_rank = run_on_ranks(_transformer_calls, 2, family, configs, 0.05, timeout_s=300)
    for rank, (rows, largest, expected_skips) in enumerate(per_rank):
        assert any(expected_skips) and not all(expected_skips[1:]), expected_skips  # diffusers skips some, not all
        for row in rows:
            where = f"{family} {row['config']} rank {rank}"
            assert row["error"] <= 1e-4 * max(1.0, largest), f"{where}: {row['error']:.3g}"
            assert row["skips"] == expected_skips, where
            assert not traffic_mismatches(row["traffic"], where), traffic_mismatches(row["traffic"], where)


def _perturbed(folder, config, agree):
    """Rank 1's local sums are made 10^6 times larger before the decision: alone, it would run every
    step while rank 0 alone would skip them (threshold 1000). Returns each rank's local verdict
    and the decisions taken."""
    pipe = load_pipeline(
        folder, config, mesh=RankMesh(config), progress=False, cache=StepCache(1000.0),
        controls=Controls(cache_agrees=agree),
    )  # fmt: skip
    cache = parallel_state(pipe.diffusers_pipeline.transformer).cache
    decide, local = cache.decide, []

    def perturbed_decide():
        if pipe.mesh.rank == 1:
            cache.sums[0] *= 1e6
        if cache.has_reference:
            differing, total = cache.sums.tolist()
            local.append(differing / total > 1000.0)
        return decide()

    cache.decide = perturbed_decide
    session = pipe.session(PROMPTS, seed=0, **_call_kwargs("pixart")).run()
    return dict(local_runs=local, skips=list(session.cache_skips), traffic=session_traffic(session))


def test_ranks_with_different_local_measures_take_one_decision(folders):
    """Agreed: both ranks run every step (the summed change is rank 1's), none hangs. Control: the
    same ranks deciding alone diverge, and the collective that rank 1 waits in times out."""
    config = ParallelConfig(ulysses=2)
    rank_0, rank_1 = run_on_ranks(_perturbed, 2, folders["pixart"], config, True, timeout_s=120)
    assert not any(rank_0["local_runs"]) and all(rank_1["local_runs"])  # alone, they would differ
    assert rank_0["skips"] == rank_1["skips"] == [False] * STEPS
    for rank, out in enumerate((rank_0, rank_1)):
        assert not traffic_mismatches(out["traffic"], f"rank {rank}"), out["traffic"]
    with pytest.raises(RankFailure, match="Timed out"):
        run_on_ranks(_perturbed, 2, folders["pixart"], config, False, timeout_s=60, collective_timeout_s=5)


def _stale_pipefusion(folder, threshold):
    config = ParallelConfig(pipefusion=2, num_patches=2, warmup_steps=1)
    pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False, cache=StepCache(threshold))
    session = pipe.session(PROMPTS, seed=0, **_call_kwargs("pixart")).run()
    stage = parallel_state(pipe.diffusers_pipeline.transformer).strategy.report().staleness
    return dict(skips=list(session.cache_skips), written=stage["written_step"], traffic=session_traffic(session))


def test_pipefusion_with_stale_steps_skips_agreed_and_keeps_old_kv(folders):
    """After warmup, PipeFusion's stages skip together; a skipped step writes no K/V in the blocks
    it skips, so the last stage's buffers record the last step that ran its blocks. Each step's bytes
    equal the closed form told the skips (stage 0 still hands every patch over at a skipped step)."""
    ranks = run_on_ranks(_stale_pipefusion, 2, folders["pixart"], THRESHOLDS["pixart"], timeout_s=120)
    skips = ranks[0]["skips"]
    assert skips == ranks[1]["skips"] and any(skips) and not all(skips[1:])
    last_run = max(i for i, skipped in enumerate(skips) if not skipped)
    assert all(steps == [last_run, last_run] for steps in ranks[1]["written"].values())
    for rank, out in enumerate(ranks):
        assert not traffic_mismatches(out["traffic"], f"rank {rank}"), out["traffic"]
    assert all(step["moved"]["pipefusion"] > 0 for step in ranks[0]["traffic"])


def test_the_cli_step_cache_equals_diffusers_first_block_cache(folders, tmp_path):
    """`xdit-lab run --cache stepcache:threshold=T` under ulysses 2, on 2 ranks given torchrun's environment (run_cli): the
    report's skipped steps and the latents equal diffusers' First-Block Cache run serially."""
    import json

    from xdit_lab.lessons import production
    from xdit_lab.testing import run_cli

    threshold = THRESHOLDS["pixart"]
    argv = production.run_argv(
        folders["pixart"], PROMPTS, ParallelConfig(ulysses=2), tmp_path, seed=0, **_call_kwargs("pixart")
    )
    job = run_cli([*argv, "--output-type", "latent", "--cache", f"stepcache:threshold={threshold}"], 2, timeout_s=240)
    assert job.codes == [0, 0], job
    assert f"StepCache({threshold}) skipped" in job.stdout, job
    report = json.loads((tmp_path / "report.json").read_text())
    expected, expected_skips = _reference(folders["pixart"], "pixart", threshold)
    assert report["cache_skips"] == expected_skips and any(expected_skips)
    latents = torch.load(tmp_path / "latents.pt")
    assert (latents - expected).abs().max() <= 1e-4 * max(1.0, expected.abs().max().item())


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="threshold must be a finite number >= 0"):
        StepCache(-0.1)
    with pytest.raises(ValueError, match="threshold must be"):
        StepCache(float("nan"))
    with pytest.raises(
        ValueError, match="method 'magcache' is not implemented; methods: first_block, teacache, dbcache"
    ):
        StepCache(0.1, method="magcache")


def _summaries_with_cache(folder, config):
    """Three steps with a threshold that skips every step after the first; a rank summary after each."""
    from xdit_lab.lab.summaries import rank_summary

    pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False, cache=StepCache(1e9))
    kwargs = dict(_call_kwargs("pixart"), num_inference_steps=3)
    session = pipe.session(PROMPTS, seed=0, **kwargs)
    return [rank_summary(session.step()) for _ in range(3)]


@pytest.mark.parametrize(
    "config", [ParallelConfig(ulysses=2), ParallelConfig(pipefusion=2, num_patches=2)], ids=lambda c: c.short()
)
def test_bytes_of_skipped_steps_equal_the_closed_form_and_the_view_draws_them(folders, config, tmp_path):
    """At a skipped step only the first block's attention moves bytes (plus the decision's all-reduce
    in group world): measured equals expected_bytes_per_step told the skips; the formula without the
    cache (control) does not. What the view reports saved (cache_savings, from the measured bytes) is
    the closed forms' difference, and draw_cache hatches the bars of the skipped steps, at the bytes
    measured."""
    from xdit_lab.lab.acceleration_views import cache_savings, draw_cache
    from xdit_lab.traffic import expected_bytes_per_step

    per_rank = run_on_ranks(_summaries_with_cache, 2, folders["pixart"], config, timeout_s=120)
    for summaries in per_rank:
        last = summaries[-1]
        assert last["cache"]["skips"] == [False, True, True]
        for step, moved in enumerate(last["comm"]["measured"]):
            moved = {g: n for g, n in moved.items() if n}
            args = (config, last["shapes"])
            assert moved == expected_bytes_per_step(
                *args, coords=last["coords"], step=step, cache_skips=[False, True, True]
            )
            if step:
                assert moved.get("world") == 8  # 2 float32 all-reduced over 2 ranks: 2 · 8 · (2-1)/2
                assert moved != expected_bytes_per_step(*args, coords=last["coords"], step=step)
        # saved per skipped step: the full step's closed form less the skipped step's (which adds the
        # decision's all-reduce); Ulysses' all-to-alls of the skipped blocks are saved, PipeFusion 2 still
        # hands every patch over (so it saves nothing and pays the all-reduce)
        full = sum(expected_bytes_per_step(config, last["shapes"], coords=last["coords"], step=1).values())
        skipped = expected_bytes_per_step(
            config, last["shapes"], coords=last["coords"], step=1, cache_skips=[False, True, True]
        )
        assert cache_savings(last)["bytes"] == 2 * (full - sum(skipped.values()))
        assert (cache_savings(last)["bytes"] > 0) == (config.ulysses > 1)
    fig = draw_cache([summaries[-1] for summaries in per_rank])
    unit = max(sum(m.values()) for s in per_rank for m in s[-1]["comm"]["measured"])  # the tallest bar
    bars = [bar for bar in fig.axes[2].patches if bar.get_height() > 0]
    hatched = sorted(round(bar.get_x() + bar.get_width() / 2) for bar in bars if bar.get_hatch())
    assert hatched == [2, 2, 3, 3], hatched  # steps 2 and 3 of both ranks, as skipped
    tallest = max(bar.get_height() for bar in bars)
    drawn = sorted(round(bar.get_height() / tallest * unit) for bar in bars)
    assert drawn == sorted(sum(m.values()) for s in per_rank for m in s[-1]["comm"]["measured"]), drawn
    from xdit_lab.lab.views import legibility_problems

    assert not legibility_problems(fig), legibility_problems(fig)
    fig.savefig(tmp_path / "cache.png")
    assert (tmp_path / "cache.png").stat().st_size > 1000


def test_step_cache_without_a_reference_is_refused_by_name():
    from xdit_lab import parallelize
    from xdit_lab.tiny import tiny_transformer

    with pytest.raises(ParallelConfigError, match="StepCache is not offered on sana"):
        parallelize(tiny_transformer("sana"), ParallelConfig(), cache=StepCache(0.1))
    with pytest.raises(
        ParallelConfigError, match="StepCache is not offered on hunyuanvideo15 yet: diffusers' First-Block Cache"
    ):
        parallelize(tiny_transformer("hunyuanvideo15"), ParallelConfig(), cache=StepCache(0.1))
