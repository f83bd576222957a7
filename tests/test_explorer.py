"""The explorer: which configurations it offers (pure, for 2 and 4 engines), why it refuses one,
and step / run / reset / apply_config on a real 2-engine Lab with the tiny PixArt, through the
controller and through the widgets (without a browser: the buttons' handlers are called).

One cluster serves the module (starting one takes ~7 s; the whole module runs in ~30 s)."""

import re

import pytest

from xdit_lab import ParallelConfig
from xdit_lab.families.tp_plan import option_refusals
from xdit_lab.lab import Lab, LabError
from xdit_lab.lab.explorer import ExplorerController, ModelShape, explain, plan, valid_configs
from xdit_lab.lab.views import legibility_problems
from xdit_lab.tiny import save_tiny_pipeline, tiny_pipeline_kwargs

# The digits model's sizes: 4 heads, 4 layers, a 16-pixel image in an 8 × 8 token grid.
DIGITS = ModelShape(family="pixart", num_heads=4, num_layers=4, rows=8, cols=8, use_cfg=True)
KWARGS = dict(tiny_pipeline_kwargs("pixart"), guidance_scale=3.0)


def shorts(configs):
    return [c.short() for c in configs]


# ---- what is offered, without engines ------------------------------------------------------------------


def test_two_engines_offer_every_pair_then_serial():
    offered = valid_configs(2, DIGITS)
    assert shorts(offered) == ["cfg2", "dp2", "pf2", "ulysses2", "ring2", "tp2", "serial"]
    assert all(not explain(c, 2, DIGITS) for c in offered)


def test_tp_is_offered_only_where_the_family_has_a_plan_and_the_load_takes_it():
    """tp is a degree like the others for a family with a tp plan (PixArt's), at the degrees that divide the heads;
    a family without one (its refusal carried by the shape) and a load whose options tp is not composed with
    (option_refusals) are offered none, and explain says why in their words."""
    four = valid_configs(4, DIGITS)
    assert {"tp2", "tp4", "cfg2·tp2", "ulysses2·tp2"} <= set(shorts(four)) and "tp3" not in shorts(four)
    assert "4 attention heads do not split over tp 3" in " ".join(explain(ParallelConfig(tp=3), 4, DIGITS))
    unplanned = ModelShape("sana", 4, 4, 8, 8, True, tp_refused="tensor parallelism has no plan for sana")
    assert not [c for c in valid_configs(4, unplanned) if c.tp > 1] and "ulysses2" in shorts(
        valid_configs(4, unplanned)
    )
    assert explain(ParallelConfig(tp=2), 2, unplanned) == ["tensor parallelism has no plan for sana"]
    options = dict(quantization="int8")  # what tp is not composed with yet (shard_weights and compile it takes)
    quantized = ModelShape("pixart", 4, 4, 8, 8, True, load_options=options)
    offered = valid_configs(4, quantized)
    assert not [c for c in offered if c.tp > 1] and "ulysses2" in shorts(offered)
    for config in (c for c in four if c.tp > 1):  # offered exactly where tp takes the load's options
        assert (config in offered) == (not option_refusals(config, **options)), config
        assert explain(config, 4, quantized) == option_refusals(config, **options)


def test_the_lab_planner_ranks_tp_where_the_family_has_a_plan_and_names_only_what_fits():
    """lab.explorer's Plan (planning.plan): tp rows beside the others for PixArt's plan, ranked as options() ranks
    them; for a family without a plan none, no reason names one (they are left out before the reasons are said),
    and tp alone is listed as refused for the model, in the refusal's words."""
    with_plan = plan(4, DIGITS)
    ranked = re.findall(r"^ *\d+  (\S+)", with_plan, flags=re.M)  # the table's rows: '10  ulysses4  ...'
    expected = ParallelConfig.options(4, num_heads=4, num_layers=4, seq_len=64, tensor_parallel=True)
    assert ranked == shorts(expected) and "tp4" in ranked
    unplanned = ModelShape("sana", 4, 4, 8, 8, True, tp_refused="tensor parallelism has no plan for sana")
    text = plan(4, unplanned)
    table = text[: text.index("refused for this model:")]
    assert "tp2" not in table and "tp4" not in table and "ulysses4" in table
    assert "  tp4: tensor parallelism has no plan for sana" in text


def test_four_engines_offer_hybrids_and_subsets():
    offered = valid_configs(4, DIGITS)
    sizes = [c.world_size for c in offered]
    assert sizes == sorted(sizes, reverse=True) and set(sizes) == {1, 2, 3, 4}  # all ranks first, then subsets
    assert {"ring3", "pf3", "dp3", "ulysses3"} <= set(shorts(offered))  # ulysses 3: 4 heads as 2 + 1 + 1
    hybrids = {"cfg2·ulysses2", "cfg2·pf2", "ulysses4", "pf4", "cfg2·ring2", "cfg2"}
    assert hybrids <= set(shorts(offered))
    assert all(not explain(c, 4, DIGITS) for c in offered)
    # a model with 2 heads cannot split them 4 ways; without guidance there is no cfg branch to split
    assert "ulysses4" not in shorts(valid_configs(4, ModelShape("pixart", 2, 4, 8, 8, True)))
    assert not [c for c in valid_configs(4, ModelShape("pixart", 4, 4, 8, 8, use_cfg=False)) if c.cfg > 1]


@pytest.mark.parametrize(
    "config, engines, expected",
    [
        (ParallelConfig(cfg=2, dp=2), 2, ["world size is 2", "cfg2, dp2, pf2", "Lab(n=4)"]),
        (ParallelConfig(ulysses=8), 8, ["4 attention heads cannot give each of ulysses 8 ranks a head"]),
        (ParallelConfig(cfg=3), 4, ["cfg must be 1 or 2"]),
        (ParallelConfig(pipefusion=2, num_patches=1), 2, ["num_patches 1 is below the 2 PipeFusion stages"]),
        (ParallelConfig(pipefusion=2, num_patches=9), 2, ["9 PipeFusion patches are row bands, but the image has 8"]),
        (ParallelConfig(pipefusion=8), 8, ["4 transformer layers cannot fill 8 PipeFusion stages"]),
    ],
)
def test_an_invalid_choice_is_explained(config, engines, expected):
    text = "\n".join(explain(config, engines, DIGITS))
    for phrase in expected:
        assert phrase in text


def test_cfg_without_guidance_is_explained():
    text = "\n".join(explain(ParallelConfig(cfg=2), 2, ModelShape("pixart", 4, 4, 8, 8, use_cfg=False)))
    assert "these calls have one; give them a guidance_scale above 1, or use cfg 1" in text
    flux2 = ModelShape("flux2", 4, 4, 8, 8, use_cfg=False, cfg_needs=None)  # guidance-distilled: never two
    assert "flux2's pipeline has one" in "\n".join(explain(ParallelConfig(cfg=2), 2, flux2))


# ---- on a real 2-engine Lab -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:  # cluster files in a fresh IPython directory
        patch.setenv("IPYTHONDIR", str(tmp_path_factory.mktemp("ipython")))
        folder = save_tiny_pipeline("pixart", tmp_path_factory.mktemp("pixart"))
        with Lab(n=2, timeout_s=60, collective_timeout_s=30) as lab:
            lab.load(folder, ParallelConfig(cfg=2), progress=False)
            yield lab


@pytest.fixture
def controller(lab):
    if lab.config != ParallelConfig(cfg=2):
        lab.configure(ParallelConfig(cfg=2))
    return ExplorerController(lab, prompt="a red cat; a blue dog", steps=3, session_kwargs=KWARGS)


def test_the_model_shape_comes_from_the_loaded_pipeline(controller):
    # the tiny PixArt: 4 heads of 16, 2 layers; 16 pixels over VAE factor 2 × patch 2 = a 4 × 4 token grid
    # PixArt has a tp plan (tp_refused None), loaded with no option tp refuses (the load's own, beside it)
    expected = ModelShape(family="pixart", num_heads=4, num_layers=2, rows=4, cols=4, use_cfg=True, hidden_size=64)
    load_options = dict(quantization=None)
    assert controller.shape == ModelShape(**{**expected.__dict__, "load_options": load_options})
    assert shorts(controller.options()) == ["cfg2", "dp2", "pf2", "ulysses2", "ring2", "tp2", "serial"]
    assert controller.choices()["tp"] == [1, 2]  # the tp picker offers what a valid configuration uses
    assert controller.choices()["num_patches"] == [None, 1, 2, 3, 4]
    assert controller.choices()["pipefusion_schedule"] == ["drained", "async"]


def test_reset_step_run(controller):
    frame = controller.reset()
    assert frame.error is None and "step 0 of 3" in frame.status
    assert list(frame.figures) == ["shards", "memory", "comm", "latent"]  # no staleness without PipeFusion
    frame = controller.step()
    assert frame.error is None and "cfg2 on 2 of 2 ranks; step 1 of 3" in frame.status
    # the step just run, in time; the steps so far
    assert list(frame.figures) == ["shards", "memory", "comm", "timeline", "history", "latent"]
    latent = frame.figures["latent"].axes[0]
    assert latent.get_images()[0].get_array().shape == (16, 16 * 2 + 1, 3)  # two prompts side by side
    frame = controller.run()
    assert "step 3 of 3 (done)" in frame.status
    # one history row per step; cfg 2 is exact, and it moves the other branch's prediction every step
    assert [row["step"] for row in controller.history] == [1, 2, 3]
    assert all(row["deviation"] <= 1e-4 and row["bytes"] > 0 for row in controller.history), controller.history
    assert "from serial < 1e-5" in frame.status
    assert not legibility_problems(frame.figures["history"])
    frame = controller.step()
    assert "all 3 steps are done" in frame.error and not frame.figures
    controller.set_request(steps=2, seed=1)
    assert "seed 0" in controller.status()  # the running session keeps its own until reset
    assert "step 0 of 2" in controller.reset().status and "seed 1" in controller.status()
    assert controller.history == []  # a new generation, a new history


def _diffusers_latents(folder, prompts, steps):
    """Diffusers' own pipeline, serially in this process, with the explorer's seed: the final latents."""
    import torch
    from diffusers import DiffusionPipeline

    reference = DiffusionPipeline.from_pretrained(folder)
    reference.set_progress_bar_config(disable=True)
    generator = torch.Generator().manual_seed(0)
    return reference(prompts, generator=generator, num_inference_steps=steps, output_type="latent", **KWARGS).images


def test_the_deviation_from_serial_is_measured_against_diffusers_own_run(controller, lab):
    """The explorer's deviation is what a serial diffusers run says it is: below 1e-4 under an exact
    strategy (ring 2), and PipeFusion's stale K/V (warmup 0: the first step reads zero-filled buffers)
    measured above that bound: the control that shows the measure can fail. Each equals the difference
    from diffusers' pipeline run here, which shares no code with the serial run the engine steps."""
    from xdit_lab.lab.measure import compare_to_serial

    reference = _diffusers_latents(lab.loaded.name_or_path, controller.prompts(), controller.steps)
    measured = {}
    for config in (ParallelConfig(ring=2), ParallelConfig(pipefusion=2, num_patches=2, warmup_steps=0)):
        assert controller.apply_config(config).error is None
        frame = controller.run()
        assert frame.error is None and len(controller.history) == controller.steps
        against_diffusers = compare_to_serial(controller.session.latents, reference)["max_relative"]
        measured[config.short()] = (controller.history[-1]["deviation"], against_diffusers)
        if config.pipefusion > 1:
            assert f"from serial {measured[config.short()][0]:.1e}" in frame.status
    (ring, ring_diffusers), (stale, stale_diffusers) = measured.values()
    assert ring <= 1e-4 and ring_diffusers <= 1e-4, measured
    assert stale > 1e-3 and abs(stale - stale_diffusers) <= 1e-4 * stale_diffusers + 1e-6, measured


def test_planning_for_gpus_the_lab_does_not_have(controller):
    """Planning mode lists every configuration of 8 GPUs this model takes (worked out here: the degrees
    multiply to 8, cfg at most 2 branches, at most 2 PipeFusion stages for 2 layers, ulysses dividing the
    4 heads), ranked; it says why a configuration ranks above the next, and why ulysses 8 and
    pipefusion 8 are refused for a model of 4 heads and 2 layers."""
    import itertools

    text = controller.plan(8)
    composed = not ParallelConfig(pipefusion=2, tp=2).problems()  # tp within a PipeFusion stage, where config.py has it
    expected = {  # tp (PixArt has a plan): dividing the 4 heads, leaving each tp rank's to ulysses
        ParallelConfig(dp=dp, cfg=cfg, pipefusion=pf, ring=ring, ulysses=ulysses, tp=tp).short()
        for dp, cfg, pf, ring, ulysses, tp in itertools.product([1, 2, 4, 8], repeat=6)
        if dp * cfg * pf * ring * ulysses * tp == 8 and cfg <= 2 and pf <= 2 and tp <= 4 and ulysses <= 4 // tp
        and (tp == 1 or pf == 1 or composed)
    }  # fmt: skip
    rows = [line.split() for line in text.splitlines()[2:] if line.split() and line.split()[0].isdigit()]
    assert len(rows) == len(expected) and {row[1] for row in rows} == expected, [row[1] for row in rows]
    assert {"dp2·tp4", "cfg2·ulysses2·tp2"} <= expected and len(expected) > 24  # tp rows among them
    assert [row[0] for row in rows] == [str(i) for i in range(1, len(expected) + 1)] and rows[0][1] == "dp4·pf2"
    assert "the same cost as dp2·cfg2·pf2, fewer degrees above 1" in text.splitlines()[2]
    assert "ulysses8: 4 attention heads cannot give each of ulysses 8 ranks a head" in text
    assert "pf8: 2 transformer layers cannot fill 8 PipeFusion stages" in text
    assert "tp8: 4 attention heads do not split over tp 8" in text
    assert "4.1 KB" in text  # dp4·pf2's patch hand-off: 2 p·hs = 2 × 16 tokens × 64 hidden × 2 bytes (bf16)
    with pytest.raises(ValueError, match="positive number of GPUs"):
        controller.plan(0)


def test_apply_config_pipefusion_then_an_invalid_one(controller, lab):
    frame = controller.apply_config(cfg=1, pipefusion=2, num_patches=2)
    assert frame.error is None and lab.config == ParallelConfig(pipefusion=2, num_patches=2)
    frame = controller.step()
    assert list(frame.figures) == ["shards", "staleness", "memory", "comm", "timeline", "history", "latent"]
    frame = controller.apply_config(ParallelConfig(cfg=2, dp=2))
    assert "dp2·cfg2 cannot run here" in frame.error and "Lab(n=4)" in frame.error
    assert lab.config == ParallelConfig(pipefusion=2, num_patches=2)  # nothing was loaded
    assert "step 2 of 3" in controller.step().status  # the session survives the refusal
    frame = controller.apply_config(ParallelConfig())
    assert frame.error is None and "serial on 1 of 2 ranks" in frame.status


def test_the_async_schedule_from_the_pickers_draws_what_the_drained_one_draws(controller, lab):
    """Picked in the panel, the async schedule runs as in code: past the warmup it reads the same stale
    K/V as the drained schedule, so its latents equal the drained session's (tests/test_pipefusion_schedule.py)."""
    frame = controller.apply_config(cfg=1, pipefusion=2, num_patches=2, warmup_steps=1, pipefusion_schedule="async")
    assert frame.error is None and "pf2·async on 2 of 2 ranks" in frame.status
    assert lab.config.pipefusion_schedule == "async"
    for _ in range(3):
        frame = controller.step()
        assert frame.error is None and "latent" in frame.figures
    assert "step 3 of 3 (done)" in frame.status
    picked = controller.session.latents
    lab.configure(ParallelConfig(pipefusion=2, num_patches=2, warmup_steps=1))
    drained = lab.session(controller.prompt.split("; "), seed=0, num_inference_steps=3, **KWARGS).run().latents
    assert (picked - drained).abs().max().item() <= 1e-4 * drained.abs().max().item()
    frame = controller.apply_config(ParallelConfig(pipefusion_schedule="async"))
    assert "pipefusion is 1" in frame.error  # async without stages is explained, and nothing loads


def test_session_timeline_draws_every_rank_and_saves_a_trace(controller, lab, tmp_path):
    import json

    session = lab.session("a cat", seed=0, num_inference_steps=2, **KWARGS)
    with pytest.raises(LabError, match="no step has run yet"):
        session.timeline()
    fig = session.step().timeline(save_trace=tmp_path / "step.json")
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["rank 0", "rank 1"]
    names = {e["name"] for e in json.loads((tmp_path / "step.json").read_text())["traceEvents"]}
    assert "all_gather cfg sample" in names and "step 1" in names  # cfg 2 gathers the two branches' predictions


def test_an_engine_error_becomes_the_frame_error(controller):
    controller.session_kwargs = dict(KWARGS, height=30)
    frame = controller.reset()
    assert "ranks 0, 1" in frame.error and "height 30 not a multiple of 4" in frame.error
    assert "error.tracebacks()" not in frame.error and "ValueError" in frame.details
    assert "\x1b[" not in frame.details  # colour codes stripped for the panel
    controller.session_kwargs = KWARGS
    assert controller.step().error is None  # a new session is started, the Lab is still usable


def test_a_cell_session_replaces_the_explorers(controller, lab):
    controller.step()
    lab.session("a cat", seed=0, num_inference_steps=2, **KWARGS)  # the Lab moved on from a cell
    frame = controller.step()
    assert frame.error is None and "step 1 of 3" in frame.status  # a new generation, not a LabError


def test_the_widgets(lab):
    from xdit_lab.lab import Explorer

    panel = lab.explorer(steps=2, session_kwargs=KWARGS)
    assert isinstance(panel, Explorer)
    assert "step 0 of 2" in panel.status.value and len(panel.views.children) == 4
    # CSS classes name the parts, for a browser (tests/browser) to find them
    assert [view._dom_classes for view in panel.views.children] == [
        (f"xdit-lab-view-{name}",) for name in ("latent", "shards", "memory", "comm")
    ]
    assert "xdit-lab-status" in panel.status._dom_classes and "xdit-lab-error" in panel.error._dom_classes
    assert "<table>" in panel.table.value and panel.configs.value == ParallelConfig(cfg=2)
    panel.buttons["step"].click()
    assert "step 1 of 2" in panel.status.value and not panel.error.value
    # planning mode for 8 GPUs, and the panel kept as static HTML for a saved notebook
    panel.gpus.value = 8
    panel.plan_button.click()
    assert "8 GPUs, pixart" in panel.plan.value and "ulysses8: 4 attention heads" in panel.plan.value
    snapshot = panel.snapshot().data
    assert snapshot.count("<img src='data:image/png;base64,") == len(panel.views.children) == 6
    assert "step 1 of 2" in snapshot and "8 GPUs, pixart" in snapshot and "alt='xdit-lab-view-history'" in snapshot
    # planning a model folder for GPUs of a size: blank is the loaded model, at the panel's request
    panel.plan_memory.value = "1GB"
    panel.plan_folder_button.click()
    assert "PixArtAlphaPipeline" in panel.plan.value and "8 GPU(s) of 1 GB" in panel.plan.value
    assert "<th>GB/rank</th>" in panel.plan.value and "<td>yes</td>" in panel.plan.value and not panel.error.value
    panel.plan_folder.value = "/nonexistent/model"  # what is wrong is said where the plan would be
    panel.plan_folder_button.click()
    assert "no model_index.json there" in panel.plan.value and not panel.error.value
    # a manual choice that cannot run is explained and cannot be applied
    panel.pickers["dp"].value = 2
    assert "cannot run" in panel.verdict.value and "Lab(n=4)" in panel.verdict.value
    assert panel.apply_button.disabled
    # a valid configuration from the list is loaded at once
    panel.configs.value = ParallelConfig(ulysses=2)
    assert lab.config == ParallelConfig(ulysses=2) and "ulysses2 on 2 of 2 ranks; step 0" in panel.status.value
    assert panel.pickers["ulysses"].value == 2 and panel.pickers["dp"].value == 1 and not panel.apply_button.disabled
    # tp is picked like any degree: from the pickers, applied, and a step runs under it
    assert [value for _, value in panel.pickers["tp"].options] == [1, 2]
    panel.pickers["ulysses"].value, panel.pickers["tp"].value = 1, 2
    assert "cannot run" not in panel.verdict.value and not panel.apply_button.disabled
    panel.apply_button.click()
    assert lab.config == ParallelConfig(tp=2) and "tp2 on 2 of 2 ranks; step 0" in panel.status.value
    panel.buttons["step"].click()
    assert "step 1 of 2" in panel.status.value and not panel.error.value
    # a new prompt takes effect on the next Step, as a new generation
    panel.prompt.value = "a green car"
    panel.buttons["run"].click()
    assert "step 2 of 2 (done)" in panel.status.value and panel.controller.prompt == "a green car"
    # an unexpected error in a callback is shown in the panel, not lost
    panel.controller.step = lambda: {}["boom"]
    panel.buttons["step"].click()
    assert "KeyError" in panel.error.value and not panel.buttons["step"].disabled
