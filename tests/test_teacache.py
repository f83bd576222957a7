"""StepCache(method="teacache") on tiny Flux under ulysses 2, ring 2 and dp 2, against TeaCache's rule written
here over diffusers' stock Flux transformer run serially.

The reference (_by_hand) is hooks on the stock blocks: before the first block, the relative L1 change of its
norm1(hidden_states, emb=temb) against the previous call's, rescaled by the polynomial and accumulated; below
the threshold every block hands its input on and the last block's image output becomes the first block's
image input plus what the stack added at the last full call; the first and the last call always run.
At threshold 0 nothing skips and every strategy equals the model without a cache; at a threshold that skips,
every strategy skips the calls the rule skips and equals its outputs (1e-4). The control, each dp rank
deciding from its own rows' sums (Controls(cache_agrees=False)), takes other decisions. Every call after the
first all-reduces two float32 tagged "cache", and each call's bytes equal traffic.py's closed form.
Through load_pipeline and a session under ulysses 2, the latents equal diffusers' FluxPipeline run serially with
the same hooks (at 0: without), and the session forces the last step's run, as the rule does."""

import pytest
import torch
from forward_traffic import forward_shapes, moved, session_traffic, traffic_mismatches

from xdit_lab import ParallelConfig, ParallelConfigError, RankMesh, StepCache, comm_log, load_pipeline, parallelize
from xdit_lab.models import Controls, parallel_state
from xdit_lab.testing import run_on_ranks
from xdit_lab.tiny import save_tiny_pipeline, tiny_inputs, tiny_pipeline_kwargs, tiny_transformer
from xdit_lab.traffic import expected_bytes_per_step

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 6
COEFFICIENTS = (2.0, 0.5, 0.0)  # a rescale that is not the identity, never negative on [0, inf)
CONFIGS = [ParallelConfig(ulysses=2), ParallelConfig(ring=2), ParallelConfig(dp=2)]


def _calls():
    """Six transformer calls on a slowly changing latent, each batch row at its own pace (so a dp rank's own
    rows measure another change than the whole batch)."""
    base = tiny_inputs("flux", 2, height=8, width=8)
    noise = torch.randn(base["hidden_states"].shape, generator=torch.Generator().manual_seed(3))
    pace = torch.tensor([0.02, 0.15]).view(2, 1, 1)
    return [dict(base, hidden_states=base["hidden_states"] + pace * i * noise) for i in range(STEPS)]


def _by_hand(model, threshold, coefficients, calls=STEPS):
    """TeaCache's rule on the serial model by hooks on its stock blocks; returns the list of skips, one per call."""
    blocks = [*model.transformer_blocks, *model.single_transformer_blocks]
    memo, skips = dict(previous=None, accumulated=0.0), []

    def before_first(block, _args, kwargs):
        modulated = block.norm1(kwargs["hidden_states"], emb=kwargs["temb"])[0]
        previous, call = memo["previous"], len(skips)
        memo["previous"] = modulated
        skip = False
        if previous is not None and call < calls - 1:
            x = ((modulated - previous).abs().mean() / previous.abs().mean()).item()
            memo["accumulated"] += sum(c * x ** (len(coefficients) - 1 - i) for i, c in enumerate(coefficients))
            skip = memo["accumulated"] < threshold
        if not skip:
            memo["accumulated"] = 0.0
        skips.append(skip)
        memo["image_in"] = kwargs["hidden_states"]

    def after(block, _args, kwargs, output):
        last = block is blocks[-1]
        if skips[-1]:
            image = kwargs["hidden_states"]
            return kwargs["encoder_hidden_states"], (memo["image_in"] + memo["added"] if last else image)
        if last:
            memo["added"] = output[1] - memo["image_in"]

    blocks[0].register_forward_pre_hook(before_first, with_kwargs=True)
    for block in blocks:
        block.register_forward_hook(after, with_kwargs=True)
    return skips


def _runs(configs, threshold, controls=None):
    calls = _calls()
    reference = tiny_transformer("flux", layers=4)
    expected_skips = _by_hand(reference, threshold, COEFFICIENTS)
    with torch.no_grad():
        expected = [reference(**x).sample for x in calls]
    rows = []
    for config in configs:
        model = tiny_transformer("flux", layers=4)
        settings = StepCache(threshold, method="teacache", coefficients=COEFFICIENTS)
        model = parallelize(model, config, RankMesh(config), cache=settings, controls=controls)
        cache = parallel_state(model).cache
        outs, traffic, agreed = [], [], []
        with torch.no_grad():
            for step, x in enumerate(calls):
                cache.final = step == STEPS - 1  # as a session sets it before its last step
                with comm_log() as log:
                    outs.append(model(**x).sample)
                state = parallel_state(model)
                closed = expected_bytes_per_step(
                    config,
                    forward_shapes(model, x),
                    coords=dict(state.mesh.coords),
                    step=step,
                    cache_skips=list(cache.skips),
                    cache_method="StepCache(teacache)",
                )
                traffic.append(dict(moved=moved(log), expected=closed))
                agreed.append(sum(r.tag == "cache" for r in log))
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
    return dict(rows=rows, largest=largest, expected_skips=expected_skips)


def _check(per_rank, skipping):
    for rank, out in enumerate(per_rank):
        assert any(out["expected_skips"]) == skipping, out["expected_skips"]
        assert not out["expected_skips"][0] and not out["expected_skips"][-1]
        for index, row in enumerate(out["rows"]):
            where = f"flux {row['config']} rank {rank}"
            assert row["error"] <= 1e-4 * max(1.0, out["largest"]), f"{where}: {row['error']:.3g}"
            assert row["skips"] == out["expected_skips"], (where, row["changes"])
            assert row["skips"] == per_rank[0]["rows"][index]["skips"], f"{where}: ranks disagree"
            assert row["agreed"] == [0] + [1] * (STEPS - 1), where  # one all-reduce per decision, tag "cache"
            assert not traffic_mismatches(row["traffic"], where), traffic_mismatches(row["traffic"], where)


# the tiny model's rescaled changes are about 0.056, 0.053, 0.048, 0.042 (whole batch): accumulated, 0.109 at the
# third call crosses 0.1 (run), 0.090 at the fifth does not (skip); each rank's own rows alone (the control) give
# about 0.010 and 0.119 a call, which skip every call and run the second
THRESHOLD = 0.1


def test_threshold_zero_equals_the_model_without_a_cache():
    _check(run_on_ranks(_runs, 2, CONFIGS, 0.0, timeout_s=300), skipping=False)


def test_every_strategy_equals_teacache_by_hand_and_the_per_rank_control_differs():
    _check(run_on_ranks(_runs, 2, CONFIGS, THRESHOLD, timeout_s=300), skipping=True)
    control = run_on_ranks(_runs, 2, [ParallelConfig(dp=2)], THRESHOLD, Controls(cache_agrees=False))
    for out in control:
        row = out["rows"][0]
        assert row["skips"] != out["expected_skips"], row
        assert row["error"] > 1e-4 * max(1.0, out["largest"]), row


def test_refused_where_not_built():
    teacache = StepCache(0.1, method="teacache")
    with pytest.raises(ParallelConfigError, match="teacache.*built for Flux only"):
        parallelize(tiny_transformer("pixart", layers=2), ParallelConfig(), cache=teacache)
    with pytest.raises(ParallelConfigError, match="teacache.*PipeFusion"):
        parallelize(tiny_transformer("flux", layers=4), ParallelConfig(pipefusion=2), cache=teacache)
    with pytest.raises(ParallelConfigError, match="compile=True does not take StepCache.method='teacache'"):
        parallelize(tiny_transformer("flux", layers=4), ParallelConfig(), cache=teacache, compile=True)
    with pytest.raises(ValueError, match="coefficients"):
        StepCache(0.1, coefficients=(1.0, 0.0))


def _pipeline_runs(folder, threshold, expected, expected_skips):
    """On every rank: load_pipeline under ulysses 2 with the TeaCache, one session: (error, skips, traffic, method)."""
    from xdit_lab.lab.summaries import rank_summary

    config = ParallelConfig(ulysses=2)
    settings = StepCache(threshold, method="teacache", coefficients=COEFFICIENTS)
    pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False, cache=settings)
    kwargs = dict(tiny_pipeline_kwargs("flux"), num_inference_steps=STEPS)
    session = pipe.session(["a red cat", "a blue dog"], seed=0, **kwargs).run()
    latents = session.result(output_type="latent").images
    out = dict(
        error=(latents - expected).abs().max().item(),
        bound=1e-4 * max(1.0, expected.abs().max().item()),
        skips=list(session.cache_skips),
        traffic=session_traffic(session),
        method=rank_summary(session)["cache"]["method"],
    )
    pipe.close()
    return out


# the pipeline's rescaled changes are about 0.059, 0.063, 0.071, 0.072, 0.075 (serial): at 0.15 the calls skip,
# skip, run (0.193), skip, and the last runs though 0.147 would skip it (a session tells the cache its last step)
@pytest.mark.parametrize("threshold", [0.0, 0.15])
def test_a_session_equals_diffusers_flux_pipeline_with_the_rule(tmp_path, threshold):
    """Through load_pipeline and a session (which tells the cache its last step): ulysses 2 equals diffusers'
    FluxPipeline run serially, without a cache at 0, with the rule's hooks on its transformer above; the
    session's steps moved what the closed form says of a TeaCache's skips."""
    from diffusers import DiffusionPipeline

    folder = save_tiny_pipeline("flux", tmp_path)
    reference = DiffusionPipeline.from_pretrained(folder)
    reference.set_progress_bar_config(disable=True)
    expected_skips = _by_hand(reference.transformer, threshold, COEFFICIENTS)
    kwargs = dict(tiny_pipeline_kwargs("flux"), num_inference_steps=STEPS)
    with torch.no_grad():
        output = reference(
            ["a red cat", "a blue dog"], generator=torch.Generator().manual_seed(0), **kwargs, output_type="latent"
        )
    assert expected_skips == ([False, True, True, False, True, False] if threshold else [False] * STEPS), expected_skips
    for rank, out in enumerate(run_on_ranks(_pipeline_runs, 2, folder, threshold, output.images, expected_skips)):
        where = f"rank {rank}"
        assert out["error"] <= out["bound"], f"{where}: {out['error']:.3g} > {out['bound']:.3g}"
        assert out["skips"] == expected_skips, where
        assert out["method"] == "StepCache(teacache)", where
        assert not traffic_mismatches(out["traffic"], where), traffic_mismatches(out["traffic"], where)


def test_the_cli_and_the_load_record_name_it():
    from xdit_lab.cli import _cache
    from xdit_lab.load_options import LoadOptions

    settings = _cache("teacache:threshold=0.15,coefficients=[2.0,0.5,0.0]")
    assert settings == StepCache(0.15, method="teacache", coefficients=COEFFICIENTS)
    record = LoadOptions(cache=settings).to_record()["cache"]
    assert record == {"threshold": 0.15, "method": "teacache", "coefficients": [2.0, 0.5, 0.0]}
    assert LoadOptions(cache=StepCache(0.2)).to_record()["cache"] == {"threshold": 0.2, "method": "first_block"}
