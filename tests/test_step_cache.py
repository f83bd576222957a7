"""StepCache against diffusers' own First-Block Cache, run serially, under every strategy.

The reference is diffusers' `apply_first_block_cache` on the stock pipeline loaded from the same
tiny folder. At threshold 0 nothing is skipped and every strategy equals diffusers without a cache;
at a threshold where some steps skip and some run, the steps skipped and the latents equal
diffusers' (1e-4 relative). The steps diffusers skipped are read from the reference itself: a
step whose last block's attention never ran was skipped.

diffusers' hooks need a cache context that only some pipelines open; for PixArt the context is
opened here by hand. (For SD3 diffusers' hooks fail: its last block returns no text, see
test_sd3_threshold_zero_and_agreed_skips.)"""

import pytest
import torch

from xdit_lab import ParallelConfig, ParallelConfigError, RankMesh, StepCache, load_pipeline
from xdit_lab.models import parallel_state
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
    last_block = [
        b for name in ("transformer_blocks", "single_transformer_blocks") for b in getattr(transformer, name, [])
    ][-1]
    ran = []
    transformer.register_forward_pre_hook(lambda *_: ran.append(False))
    attention = getattr(last_block, "attn", None) or last_block.attn1
    attention.register_forward_pre_hook(lambda *_: ran.__setitem__(-1, True))
    kwargs = _call_kwargs(family)
    if "negative_prompt" in kwargs:
        kwargs["negative_prompt"] = kwargs["negative_prompt"][: len(prompts)]
    output = pipe(prompts, generator=torch.Generator().manual_seed(0), output_type="latent", **kwargs)
    return _latents(output, family), [not r for r in ran]


def _against_diffusers(folder, family, configs, threshold, prompts=PROMPTS):
    """On every rank: diffusers' reference, then each configuration with StepCache(threshold)."""
    expected, expected_skips = _diffusers_first_block_cache(folder, family, threshold or None, prompts)
    kwargs = _call_kwargs(family)
    if "negative_prompt" in kwargs:
        kwargs["negative_prompt"] = kwargs["negative_prompt"][: len(prompts)]
    rows = []
    for config in configs:
        pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False, cache=StepCache(threshold))
        result = pipe(prompts, seed=0, output_type="latent", **kwargs)
        latents = _latents(result, family)
        rows.append(
            dict(
                config=config.short(),
                error=(latents - expected).abs().max().item(),
                bound=1e-4 * max(1.0, expected.abs().max().item()),
                skips=result.cache_skips,
                expected_skips=expected_skips,
                cache_bytes=[step.get("world", 0) for step in result.comm_per_step],
                groups=sorted({g for step in result.comm_per_step for g, b in step.items() if b}),
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
            degrees = {g for g in ("ulysses", "ring", "cfg", "dp", "pipefusion") if getattr(config, g) > 1}
            assert degrees <= set(row["groups"]), where
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


@pytest.mark.parametrize("threshold", [0.0, THRESHOLDS["pixart"]], ids=["threshold0", "skipping"])
def test_pixart_every_strategy_equals_diffusers_first_block_cache(folders, threshold):
    for world_size, configs in ((1, [ParallelConfig()]), (2, PIXART_2)):
        per_rank = run_on_ranks(
            _against_diffusers, world_size, folders["pixart"], "pixart", configs, threshold, timeout_s=300
        )
        _check(per_rank, configs, "pixart", skipping=threshold > 0)


def test_dp_stand_in_rows_do_not_count_in_the_decision(folders):
    """One prompt with CFG is a batch of two rows [uncond; cond]; dp 3 gives them to two groups, and
    the third computes a stand-in copy of the last row. Counted in the sums, it would weigh the
    conditional row twice and move the decision; the skipped steps and latents equal diffusers'.
    Threshold 0.13 lies between the change at step 3 without the stand-in (0.128) and with it (0.131)."""
    configs = [ParallelConfig(dp=3)]
    per_rank = run_on_ranks(_against_diffusers, 3, folders["pixart"], "pixart", configs, 0.13, ["a red cat"])
    _check(per_rank, configs, "pixart", skipping=True)


def test_pixart_hybrids_on_4_ranks_equal_diffusers_first_block_cache(folders):
    threshold = THRESHOLDS["pixart"]
    per_rank = run_on_ranks(_against_diffusers, 4, folders["pixart"], "pixart", PIXART_4, threshold, timeout_s=400)
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
    for world_size, threshold in ((2, 0.0), (2, THRESHOLDS[family]), (4, THRESHOLDS[family])):
        runs = run_on_ranks(
            _against_diffusers, world_size, folders[family], family, configs[world_size], threshold, timeout_s=400
        )
        _check(runs, configs[world_size], family, skipping=threshold > 0)


def _ours(folder, family, configs, threshold):
    rows = []
    for config in configs:
        pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False, cache=StepCache(threshold))
        result = pipe(PROMPTS, seed=0, output_type="latent", **_call_kwargs(family))
        rows.append(dict(config=config.short(), latents=_latents(result, family), skips=result.cache_skips))
        pipe.close()
    return rows


def test_sd3_threshold_zero_and_agreed_skips(folders):
    """diffusers' First-Block Cache fails on SD3 (its last block returns no text to take a residual
    of); ours handles it. Threshold 0 equals diffusers without a cache; at a threshold that skips,
    every strategy (USP and cfg 2 × ulysses 2 on 4 ranks too) skips the steps the serial run skips,
    with latents within 1e-4 of it."""
    configs = [
        ParallelConfig(ulysses=2),
        ParallelConfig(ring=2),
        ParallelConfig(cfg=2),
        ParallelConfig(dp=2),
        ParallelConfig(pipefusion=2, num_patches=4, warmup_steps=STEPS),
    ]
    per_rank = run_on_ranks(_against_diffusers, 2, folders["sd3"], "sd3", configs, 0.0, timeout_s=300)
    _check(per_rank, configs, "sd3", skipping=False)
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


def _ours_on(world_size, folder, configs):
    return run_on_ranks(_ours, world_size, folder, "sd3", configs, THRESHOLDS["sd3"], timeout_s=300)


def _transformer_calls(family, configs, threshold):
    """DiT and Wan have no pipeline here: six transformer calls on a slowly changing latent, as steps are."""
    from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache
    from diffusers.hooks.hooks import CacheContext, _set_cache_context

    from xdit_lab import parallelize
    from xdit_lab.tiny import tiny_inputs, tiny_transformer

    base = tiny_inputs(family, 2, height=8, width=8)
    noise = torch.randn(base["hidden_states"].shape, generator=torch.Generator().manual_seed(3))
    calls = [dict(base, hidden_states=base["hidden_states"] + 0.05 * i * noise) for i in range(STEPS)]
    reference = tiny_transformer(family, layers=4)
    apply_first_block_cache(reference, FirstBlockCacheConfig(threshold=threshold))
    _set_cache_context(reference, CacheContext("all"))
    with torch.no_grad():
        expected = [reference(**x).sample for x in calls]
    rows = []
    for config in configs:
        model = parallelize(tiny_transformer(family, layers=4), config, RankMesh(config), cache=StepCache(threshold))
        with torch.no_grad():
            outs = [model(**x).sample for x in calls]
        error = max((o - e).abs().max().item() for o, e in zip(outs, expected))
        rows.append(dict(config=config.short(), error=error, skips=parallel_state(model).cache.skips))
    return rows, max(e.abs().max().item() for e in expected)


@pytest.mark.parametrize("family", ["dit", "wan"])  # Flux.2: diffusers' own cache raises, no reference
def test_transformer_without_recipe_equals_diffusers_first_block_cache(family):
    configs = [ParallelConfig(ulysses=2), ParallelConfig(ring=2), ParallelConfig(cfg=2), ParallelConfig(dp=2)]
    if family == "dit":
        configs.append(ParallelConfig(pipefusion=2, warmup_steps=STEPS))
    skipped = []
    for rank, (rows, largest) in enumerate(run_on_ranks(_transformer_calls, 2, family, configs, 0.05, timeout_s=300)):
        for row in rows:
            assert row["error"] <= 1e-4 * max(1.0, largest), f"{family} {row['config']} rank {rank}: {row['error']:.3g}"
            skipped.append(tuple(row["skips"]))
    assert len(set(skipped)) == 1 and any(skipped[0]) and not all(skipped[0][1:]), skipped


def _perturbed(folder, config, agree):
    """Rank 1's local sums are made 10^6 times larger before the decision: alone, it would run every
    step while rank 0 alone would skip them (threshold 1000). Returns each rank's local verdict
    and the decisions taken."""
    pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False, cache=StepCache(1000.0))
    cache = parallel_state(pipe.diffusers_pipeline.transformer).cache
    cache.agree = agree
    decide, local = cache.decide, []

    def perturbed_decide():
        if pipe.mesh.rank == 1:
            cache.sums[0] *= 1e6
        if cache.has_reference:
            differing, total = cache.sums.tolist()
            local.append(differing / total > 1000.0)
        return decide()

    cache.decide = perturbed_decide
    result = pipe(PROMPTS, seed=0, output_type="latent", **_call_kwargs("pixart"))
    return dict(local_runs=local, skips=result.cache_skips)


def test_ranks_with_different_local_measures_take_one_decision(folders):
    """Agreed: both ranks run every step (the summed change is rank 1's), none hangs. Control: the
    same ranks deciding alone diverge, and the collective that rank 1 waits in times out."""
    config = ParallelConfig(ulysses=2)
    rank_0, rank_1 = run_on_ranks(_perturbed, 2, folders["pixart"], config, True, timeout_s=120)
    assert not any(rank_0["local_runs"]) and all(rank_1["local_runs"])  # alone, they would differ
    assert rank_0["skips"] == rank_1["skips"] == [False] * STEPS
    with pytest.raises(RankFailure, match="Timed out"):
        run_on_ranks(_perturbed, 2, folders["pixart"], config, False, timeout_s=60, collective_timeout_s=5)


def _stale_pipefusion(folder, threshold):
    config = ParallelConfig(pipefusion=2, num_patches=2, warmup_steps=1)
    pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False, cache=StepCache(threshold))
    result = pipe(PROMPTS, seed=0, output_type="latent", **_call_kwargs("pixart"))
    stage = parallel_state(pipe.diffusers_pipeline.transformer).strategy.staleness()
    return dict(skips=result.cache_skips, written=stage["written_step"], groups=result.comm_per_step[-1])


def test_pipefusion_with_stale_steps_skips_agreed_and_keeps_old_kv(folders):
    """After warmup, PipeFusion's stages skip together; a skipped step writes no K/V in the blocks
    it skips, so the last stage's buffers record the last step that ran its blocks."""
    ranks = run_on_ranks(_stale_pipefusion, 2, folders["pixart"], THRESHOLDS["pixart"], timeout_s=120)
    skips = ranks[0]["skips"]
    assert skips == ranks[1]["skips"] and any(skips) and not all(skips[1:])
    last_run = max(i for i, skipped in enumerate(skips) if not skipped)
    assert all(steps == [last_run, last_run] for steps in ranks[1]["written"].values())
    assert ranks[0]["groups"]["pipefusion"] > 0


def test_torchrun_cli_cache_threshold_equals_diffusers_first_block_cache(folders, tmp_path):
    """`xdit-lab run --cache-threshold T` under torchrun, ulysses 2: the report's skipped steps and
    the latents equal diffusers' First-Block Cache run serially."""
    import json

    from xdit_lab.distributed import free_port
    from xdit_lab.lessons import production

    threshold = THRESHOLDS["pixart"]
    argv = production.run_argv(
        folders["pixart"], PROMPTS, ParallelConfig(ulysses=2), tmp_path, seed=0, **_call_kwargs("pixart")
    )
    command = production.torchrun_argv(2, master_port=free_port()) + ["-m", "xdit_lab.cli", *argv]
    command += ["--output-type", "latent", "--cache-threshold", str(threshold)]
    (result,) = production.run_processes([command], 240)
    assert result["returncode"] == 0 and not result["timed_out"], result["output"][-4000:]
    assert f"StepCache({threshold}) skipped" in result["output"]
    report = json.loads((tmp_path / "report.json").read_text())
    expected, expected_skips = _diffusers_first_block_cache(folders["pixart"], "pixart", threshold)
    assert report["cache_skips"] == expected_skips and any(expected_skips)
    latents = torch.load(tmp_path / "latents.pt")
    assert (latents - expected).abs().max() <= 1e-4 * max(1.0, expected.abs().max().item())


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="threshold must be a finite number >= 0"):
        StepCache(-0.1)
    with pytest.raises(ValueError, match="threshold must be"):
        StepCache(float("nan"))
    with pytest.raises(ValueError, match="method 'teacache' is not implemented; methods: first_block"):
        StepCache(0.1, method="teacache")


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
    cache (control) does not. draw_cache shows the same skips."""
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
        assert cache_savings(last)["skipped"] == 2
        # Ulysses' all-to-alls of the skipped blocks are saved; PipeFusion 2 still hands every patch over
        assert (cache_savings(last)["bytes"] > 0) == (config.ulysses > 1)
    fig = draw_cache([summaries[-1] for summaries in per_rank])
    assert "skipped 2 of 3 steps" in fig._suptitle.get_text()
    from xdit_lab.lab.views import legibility_problems

    assert not legibility_problems(fig), legibility_problems(fig)
    fig.savefig(tmp_path / "cache.png")
    assert (tmp_path / "cache.png").stat().st_size > 1000


def test_step_cache_without_a_reference_is_refused_by_name():
    from xdit_lab import parallelize
    from xdit_lab.tiny import tiny_transformer

    with pytest.raises(ParallelConfigError, match="StepCache is not offered on flux2"):
        parallelize(tiny_transformer("flux2"), ParallelConfig(), cache=StepCache(0.1))
