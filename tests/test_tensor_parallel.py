"""Tensor parallelism (models/tensor_parallel.py) against diffusers' serial forward and pipeline.

Each rank builds the same tiny model, runs it serially for the reference, then parallelizes it under tp and compares
the full output: max abs error <= 1e-4 · max(1, max |reference|) in float32. Beside it: the parameter bytes a rank
holds equal the plan's (at most 0.6 of the model under tp 2), every collective that ran is one of comm's records
(torch's dispatcher sees no other: DTensor sends nothing of its own), and the tp group's bytes equal
the closed form (traffic.expected_bytes_per_step, its tp term tp_bytes_per_forward)."""

import copy
import dataclasses
import json

import pytest
import torch
from forward_traffic import sample, session_traffic, traffic_mismatches, traffic_row

from xdit_lab import ParallelConfig, ParallelConfigError, RankMesh, comm_log, load_pipeline, parallelize, unparallelize
from xdit_lab.families import family as family_module
from xdit_lab.models import parallel_state
from xdit_lab.testing import run_on_ranks
from xdit_lab.tiny import PIPELINES as PIPELINE_CLASSES
from xdit_lab.tiny import save_tiny_pipeline, tiny_inputs, tiny_pipeline_kwargs, tiny_transformer

BATCH, TEXT = 2, 8
HEADS = {"zimage": 4, "hunyuanvideo15": 4}  # the families whose tiny model has 3 heads, which tp 2 does not divide
# the most of its tiny model a tp 2 rank holds: 0.6, or more where a layer of fixed size outweighs the blocks at
# the tiny size (Z-Image's timestep MLP, 256 -> 1024 -> 256: 56% of it, 0.01% of Z-Image-Turbo; test_a_real_model_s
# checks the real shapes)
MOST = {"zimage": 0.8, "hunyuanvideo15": 0.97, "dit": 0.62}  # HunyuanVideo-1.5's ByT5 projection (2048 wide): 91%;
# DiT's: the per-block timestep and class embedders


def _held_bytes(model) -> int:
    """Parameter bytes this rank holds: a DTensor's local shard, any other parameter whole."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in model.parameters())


def _serial(family):
    """The tiny model, its inputs and its serial output."""
    model = tiny_transformer(family, seed=0, heads=HEADS.get(family))
    inputs = tiny_inputs(family, BATCH, height=8, width=8, text_len=TEXT)
    with torch.no_grad():
        reference = sample(model(**inputs))
    return model, inputs, reference


def _collectives():
    """A dispatch mode counting every collective torch runs, DTensor's own included: it lets DTensor take its ops
    first (NotImplemented), so the collectives DTensor issues inside them pass through it too (as torch's
    CommDebugMode counts them, without its module tracker)."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class Collectives(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(t is DTensor for t in types):
                return NotImplemented
            # a receive is its peer's send, which comm records; a wait completes what was counted
            if func.namespace in ("c10d", "_c10d_functional") and not func.__name__.startswith(("wait", "recv")):
                self.count += 1
            return func(*args, **(kwargs or {}))

    return Collectives()


def _forward(family, configs):
    rows = []
    for config in configs:
        mesh = RankMesh(config)
        model, inputs, reference = _serial(family)
        whole = _held_bytes(model)
        model = parallelize(model, config, mesh)
        with torch.no_grad(), comm_log() as log, _collectives() as seen_by_torch:
            output = sample(model(**inputs))
        tensor = parallel_state(model).tensor
        traffic = traffic_row(model, inputs, log, step=0)  # every group's bytes beside the closed form
        with pytest.raises(ValueError, match=r"split over tp \d ranks \(DTensor\), which is not undone"):
            unparallelize(model)
        rows.append(
            dict(
                config=config.short(),
                error=(output - reference).abs().max().item(),
                bound=1e-4 * max(1.0, reference.abs().max().item()),
                whole=whole,
                held=_held_bytes(model),
                planned=tensor.planned_bytes,
                planned_whole=tensor.whole_bytes,
                traffic=traffic,
                ops=sorted({(r.op, r.group) for r in log}),
                recorded=len(log.records),
                collectives=seen_by_torch.count,
            )
        )
    return rows


def _check(per_rank, family):
    for rank, rows in enumerate(per_rank):
        for row in rows:
            where = f"{family} {row['config']} rank {rank}"
            assert row["error"] <= row["bound"], f"{where}: error {row['error']:.3g} > {row['bound']:.3g}"
            assert row["held"] == row["planned"] and row["planned_whole"] == row["whole"], where
            assert row["held"] <= MOST.get(family, 0.6) * row["whole"], (
                f"{where}: holds {row['held'] / row['whole']:.3f} of the model"
            )
            assert row["traffic"]["moved"] == row["traffic"]["expected"], where
            assert row["traffic"]["moved"]["tp"] > 0, where
            assert ("all_reduce", "tp") in row["ops"] and ("all_gather", "tp") in row["ops"], where
            assert row["collectives"] == row["recorded"], f"{where}: a collective ran that comm did not record"


def _dtensor_all_reduce():
    """The control of the count: torch's own RowwiseParallel (output replicated: DTensor all-reduces it) on two
    Linear layers, which comm does not see."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8))
    parallelize_module(
        model, DeviceMesh.from_group(dist.group.WORLD, "cpu"), {"0": ColwiseParallel(), "1": RowwiseParallel()}
    )
    with torch.no_grad(), comm_log() as log, _collectives() as seen_by_torch:
        model(torch.randn(2, 8))
    return len(log.records), seen_by_torch.count


def test_the_count_sees_dtensor_s_own_collectives():
    for recorded, seen in run_on_ranks(_dtensor_all_reduce, 2):
        assert recorded == 0 and seen >= 1  # DTensor's all-reduce (a functional op and the c10d op it runs)


@pytest.mark.parametrize(
    "family",
    [
        "flux",
        "flux2",
        "qwenimage",
        "wan",
        "hunyuanvideo",
        "cogvideox",
        "sd3",
        "pixart",
        "zimage",
        "hunyuanvideo15",
        "dit",
    ],
)
def test_tp2_forward_equals_serial_diffusers(family):
    """diffusers' _tp_plan (Flux, Flux.2, Qwen-Image) or the adapter's (Wan, with its RMSNorm over every head)."""
    _check(run_on_ranks(_forward, 2, family, [ParallelConfig(tp=2)], timeout_s=240), family)


def test_tp2_composes_with_ring_and_dp_on_4_ranks():
    """Flux's; every family's tp2·ulysses2, tp2·cfg2 and tp2·pf2 are in tests/test_tp_families.py."""
    configs = [ParallelConfig(tp=2, ring=2), ParallelConfig(tp=2, dp=2)]
    per_rank = run_on_ranks(_forward, 4, "flux", configs, timeout_s=240)
    _check(per_rank, "flux")
    for rows in per_rank:
        assert {"ring", "tp"} <= {group for _, group in rows[0]["ops"]}
        assert {"dp", "tp"} <= {group for _, group in rows[1]["ops"]}


def _uneven(config):
    """6 heads: 3 a tp rank, which Ulysses 2 splits 2 and 1; 7 text tokens, cut 4 and 3."""
    model = tiny_transformer("flux", seed=0, heads=6)
    inputs = tiny_inputs("flux", BATCH, height=8, width=8, text_len=7)
    with torch.no_grad():
        reference = sample(model(**inputs))
    model = parallelize(model, config)
    with torch.no_grad(), comm_log() as log:
        output = sample(model(**inputs))
    error, bound = (output - reference).abs().max().item(), 1e-4 * max(1.0, reference.abs().max().item())
    return error, bound, traffic_row(model, inputs, log, step=0)


def test_tp2_ulysses2_with_heads_and_text_that_do_not_split_evenly():
    for error, bound, traffic in run_on_ranks(_uneven, 4, ParallelConfig(tp=2, ulysses=2), timeout_s=240):
        assert error <= bound, f"error {error:.3g} > {bound:.3g}"
        assert traffic["moved"] == traffic["expected"] and {"tp", "ulysses"} <= set(traffic["moved"])


def _pipeline(folder, configs, kwargs, expected):
    from xdit_lab.lessons.families import output_latents
    from xdit_lab.models.sharded_weights import held_checkpoint_bytes

    rows = []
    for config in configs:  # several configurations a launch of ranks: the ranks start once
        pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False)
        session = pipe.session(["a red cat", "a blue dog"], seed=0, **kwargs).run()
        latents = output_latents(session.result(output_type="latent"))
        error, bound = (latents - expected).abs().max().item(), 1e-4 * max(1.0, expected.abs().max().item())
        # the transformer's bytes on this rank, planned from the headers before a weight was read, and held
        held = (
            pipe.memory_plan.per_rank_bytes["transformer"],
            held_checkpoint_bytes(pipe.diffusers_pipeline.transformer),
        )
        traffic = session_traffic(session)
        groups = {group for step in traffic for group in step["moved"]}
        rows.append((config.short(), error, bound, traffic_mismatches(traffic, config.short()), held, groups))
    return rows


TP2 = ParallelConfig(tp=2)
COMPOSED = [ParallelConfig(tp=2, ulysses=2), ParallelConfig(tp=2, cfg=2)]  # cfg 2: the families with true CFG
TP2_PF2 = ParallelConfig(tp=2, pipefusion=2, warmup_steps=3)  # every step of the 3 warms up: exact
PIPELINES = {  # family: the configurations its pipeline runs under, by world size (Flux.2 is guidance-distilled)
    "flux": {2: [TP2], 4: [ParallelConfig(tp=2, cfg=2), TP2_PF2]},
    "flux2": {2: [TP2]},
    "qwenimage": {2: [TP2]},
    "wan": {2: [TP2]},  # the adapter's plan
    "pixart": {2: [TP2]},  # self and cross attention, one shared modulation
    "hunyuanvideo": {2: [TP2], 4: COMPOSED},  # double and single streams, the token refiner whole-text
    "hunyuanvideo15": {2: [TP2], 4: COMPOSED},  # 4 heads (its tiny model's 3 do not split over tp 2)
    "cogvideox": {2: [TP2], 4: COMPOSED},  # one joint stream of [text; image]
    "sd3": {2: [TP2], 4: [*COMPOSED, TP2_PF2]},
    "zimage": {2: [TP2], 4: COMPOSED},  # 4 heads; the refiners' and the joint layers' tokens
}
TRUE_CFG = ("flux", "qwenimage", "hunyuanvideo")  # whose pipelines guide with negatives only at true_cfg_scale > 1


def _folder(family, path):
    """The family's tiny pipeline saved as a folder, its transformer with HEADS heads where its own do not split
    over tp 2 (Z-Image's and HunyuanVideo-1.5's 3)."""
    from xdit_lab.tiny import tiny_pipeline

    if family not in HEADS:
        return save_tiny_pipeline(family, path)
    pipe = tiny_pipeline(family)
    part = dict(family_module(family).TINY.parts_of(PIPELINE_CLASSES[family]))["transformer"]
    pipe.transformer = tiny_transformer(family, seed=0, heads=HEADS[family], **part.kwargs)
    pipe.save_pretrained(path, safe_serialization=True)
    size = {key: value for key, value in family_module(family).TINY.call.items() if key in ("height", "width")}
    (path / "call_defaults.json").write_text(json.dumps(size))
    return path


@pytest.mark.parametrize("family", PIPELINES)
def test_pipeline_under_tp_equals_diffusers_pipeline(family, tmp_path):
    """Each family's pipeline under tp 2, and composed with ulysses 2, cfg 2 or PipeFusion 2 (each stage's blocks
    split over its tp ranks) on 4 ranks, against diffusers' serial pipeline; each step's bytes per group (tp's
    included) as the closed form, the transformer's bytes a rank holds as planned from the headers."""
    from diffusers import DiffusionPipeline

    from xdit_lab.config import SHORT
    from xdit_lab.lessons.families import output_latents

    folder = _folder(family, tmp_path / family)
    kwargs = dict(tiny_pipeline_kwargs(family), num_inference_steps=3)
    if family != "flux2":  # real guidance: two branches, for cfg 2 to split
        kwargs["negative_prompt"] = ["", "a photo"]
    if family in TRUE_CFG:
        kwargs["true_cfg_scale"] = 2.0
    reference = DiffusionPipeline.from_pretrained(folder)
    reference.set_progress_bar_config(disable=True)
    generator = torch.Generator().manual_seed(0)
    # a copy of the negatives: ZImagePipeline writes its chat template into the list it is given
    expected = output_latents(
        reference(
            prompt=["a red cat", "a blue dog"], generator=generator, output_type="latent", **copy.deepcopy(kwargs)
        )
    )
    for world, configs in PIPELINES[family].items():
        per_rank = run_on_ranks(_pipeline, world, folder, configs, kwargs, expected, timeout_s=300)
        # the plan is the busiest rank's (under PipeFusion, the stage that holds the most): each holds at most that
        busiest = [max(rows[i][4][1] for rows in per_rank) for i in range(len(configs))]
        for rows in per_rank:
            for (config, error, bound, mismatches, (planned, held), groups), most in zip(rows, busiest):
                assert error <= bound, f"{family} {config}: error {error:.3g} > {bound:.3g}"
                assert planned == most >= held, f"{family} {config}: planned {planned} bytes of the transformer, {held}"
                assert not mismatches, mismatches  # each step's bytes per group, tp's included, as the closed form
                named = {short: group for group, short in SHORT.items()}
                assert {named[n] for n in config.replace("2", "").split("·")} <= groups, f"{family} {config}: {groups}"


@pytest.mark.parametrize(
    "class_name, settings",
    [
        ("FluxTransformer2DModel", {}),  # diffusers' defaults: FLUX.1-dev's shape
        ("Flux2Transformer2DModel", {}),  # FLUX.2-dev's
        ("QwenImageTransformer2DModel", {}),  # Qwen-Image's
        ("WanTransformer3DModel", dict(num_attention_heads=40, ffn_dim=13824, num_layers=40)),  # Wan2.1-14B's
        ("HunyuanVideoTransformer3DModel", {}),  # HunyuanVideo's
        ("CogVideoXTransformer3DModel", {}),  # CogVideoX-2b's
        ("SD3Transformer2DModel", {}),  # SD3 Medium's (its embedders whole: 0.506 of it, 0.259)
        ("PixArtTransformer2DModel", {}),  # PixArt-α's
        ("ZImageTransformer2DModel", {}),  # Z-Image-Turbo's
        ("DiTTransformer2DModel", {}),  # DiT-XL/2's (each block's own timestep and class embedders whole: 0.552)
        ("HunyuanVideo15Transformer3DModel", {}),  # HunyuanVideo-1.5's (its token refiner whole: 0.510, 0.265)
    ],
)
def test_a_real_model_s_tp_rank_holds_half_of_it(class_name, settings):
    """The plan on the real shapes (built on the meta device: no weight is made): diffusers' plan with the
    modulations split too leaves a tp 2 rank about half of the transformer (FLUX.1-dev: 0.501; diffusers' plan alone
    would leave 0.64), a tp 4 rank about a quarter."""
    import diffusers

    from xdit_lab.families import adapter_for
    from xdit_lab.models.tensor_parallel import planned_bytes

    with torch.device("meta"):
        model = getattr(diffusers, class_name)(**settings)
    adapter = adapter_for(model)
    slack = dict(SD3Transformer2DModel=0.005, HunyuanVideo15Transformer3DModel=0.01, DiTTransformer2DModel=0.075)
    slack = slack.get(class_name, 0)
    for tp, most in ((2, 0.505 + slack), (4, 0.255 + slack)):
        whole, held = planned_bytes(model, adapter, tp)
        assert held <= most * whole, f"{class_name} tp {tp}: {held / whole:.3f} of the model"
    # the control: diffusers' plan alone keeps the modulations whole (FLUX.1-dev's rank then holds 0.64 of it)
    _, with_them = planned_bytes(model, adapter, 2)
    _, without = planned_bytes(model, dataclasses.replace(adapter, tp_gathered=()), 2)
    assert without > with_them and (class_name != "FluxTransformer2DModel" or without > 0.6 * whole)


def test_tp_in_the_config_its_cost_and_its_names():
    config = ParallelConfig(cfg=2, ulysses=2, tp=2)
    assert (config.world_size, config.short(), config.spelled()) == (
        8,
        "cfg2·ulysses2·tp2",
        "cfg 2 × ulysses 2 × tp 2 = 8",
    )
    assert "tp=2" in repr(config) and "tp" not in repr(ParallelConfig(ulysses=2))  # tp 1 is said as before
    alone, split = ParallelConfig(ulysses=2).cost(28, use_cfg=False), config.replace(cfg=1).cost(28, use_cfg=False)
    assert split.work_fraction == alone.work_fraction / 2 and split.params_fraction == 0.5
    # Ulysses moves half the heads; tp all-reduces [p/2, hs] twice a layer: 2 · 2(2-1)/2 / 2 · 28
    assert split.comm_p_hs == pytest.approx(alone.comm_p_hs / 2 + 28)
    # options() ranks tp only when asked (a family with a plan), PipeFusion's stages split over tp too
    listed = [c.short() for c in ParallelConfig.options(4, num_heads=24, num_layers=28, tensor_parallel=True)]
    assert {"ulysses2·tp2", "tp4", "cfg2·tp2", "pf2·tp2"} <= set(listed)
    assert listed.index("ulysses4") < listed.index("ulysses2·tp2")  # the same work; tp's all-reduces send more
    assert not [c for c in ParallelConfig.options(4, num_heads=24) if c.tp > 1]
    assert "ulysses2·tp2" not in [c.short() for c in ParallelConfig.options(4, num_heads=3, tensor_parallel=True)]


# ---- refusals: each before a process group is made or a layer split ----------------------------------------------


def test_a_tp_degree_that_does_not_divide_the_heads_names_those_that_do():
    said = ParallelConfig(tp=3).problems(num_heads=4)
    assert said and "4 attention heads do not split over tp 3" in said[0] and "[2, 4]" in said[0]
    said = ParallelConfig(tp=2, ulysses=4).problems(num_heads=4)
    assert said and "heads of each tp 2 rank cannot give each of ulysses 4 ranks a head" in said[0]
    assert ParallelConfig(tp=2, ulysses=2).problems(num_heads=4) == []


def test_tp_refuses_what_it_is_not_composed_with_by_name():
    said = " ".join(ParallelConfig(tp=2, pipefusion=2, pipefusion_schedule="async").problems())
    assert "not yet with pipefusion_schedule='async'" in said and "use the drained schedule with tp" in said
    said = " ".join(ParallelConfig(tp=2, ulysses=2, comm_dtype="float8_e4m3fn").problems())
    assert "comm_dtype 'float8_e4m3fn' is not composed with tp 2 yet" in said


def test_tp_refuses_a_family_without_a_plan_and_a_width_it_does_not_divide():
    with pytest.raises(ParallelConfigError, match=r"no plan for ltx2 .*audio stream.*declares no _tp_plan.*use tp 1"):
        parallelize(tiny_transformer("ltx2"), ParallelConfig(tp=2))
    with pytest.raises(ParallelConfigError, match=r"no plan for sana .*GLUMBConv\) is convolutions.*use tp 1"):
        parallelize(tiny_transformer("sana"), ParallelConfig(tp=2))
    # Wan's MLP 33 wide: tp 2 divides the heads, not the MLP; the layers and the degrees that fit are named
    with pytest.raises(
        ParallelConfigError, match=r"tp 2 does not divide .*blocks\.0\.ffn\.net\.0\.proj.*use tp in \[1\]"
    ):
        parallelize(tiny_transformer("wan", ffn_dim=33), ParallelConfig(tp=2))
    # Wan 2.1 I2V's image keys and values, which its plan does not split beside the heads it splits
    with pytest.raises(ParallelConfigError, match=r"does not split beside the heads .*attn2\.add_k_proj.*use tp 1"):
        parallelize(tiny_transformer("wan", image_dim=16, added_kv_proj_dim=64), ParallelConfig(tp=2))


def test_the_planner_refuses_from_the_headers_what_parallelize_refuses(tmp_path):
    """header_problems reads problems() off a checkpoint's names and shapes (a planner has no module); LoadOptions
    refuses tp with quantized weights, so plan_model never lists such a row, and takes it with sharded or compiled
    ones (tests/test_tp_options.py)."""
    import diffusers

    from xdit_lab.families import adapter_for, recipe_for
    from xdit_lab.families.tp_plan import header_problems
    from xdit_lab.load_options import LoadOptions
    from xdit_lab.model_folder import read_model_folder
    from xdit_lab.models.tensor_parallel import problems

    def both(model):
        adapter = adapter_for(model)
        headers = [(name, tuple(t.shape)) for name, t in model.state_dict().items()]
        return header_problems(headers, type(model), adapter, 2), problems(model, adapter, 2)

    for model, named in [
        (tiny_transformer("flux"), None),
        (tiny_transformer("wan"), None),
        (tiny_transformer("wan", ffn_dim=33), "blocks.0.ffn.net.0.proj"),
        (tiny_transformer("wan", image_dim=16, added_kv_proj_dim=64), "attn2.add_k_proj"),
    ]:
        from_headers, from_module = both(model)
        assert bool(from_headers) == bool(from_module) == (named is not None)
        assert named is None or named in from_headers[0]

    folder = read_model_folder(save_tiny_pipeline("flux", tmp_path / "flux"), torch.float32)
    recipe = recipe_for(folder.pipeline_class)
    for options in (LoadOptions(), LoadOptions(shard_weights=True), LoadOptions(compile=True)):
        assert options.problems(recipe, folder, ParallelConfig(tp=2)) == [], options
    said = " ".join(LoadOptions(quantization="int8").problems(recipe, folder, ParallelConfig(tp=2)))
    assert "quantization 'int8' is not composed with tp 2 yet" in said, said
    assert getattr(diffusers, folder.transformer.class_name)._tp_plan


def test_tp_refuses_quantized_weights_by_name():
    pytest.importorskip("torchao")
    from torchao.quantization import Float8WeightOnlyConfig, Int8WeightOnlyConfig, quantize_

    model = tiny_transformer("flux")
    quantize_(model, Int8WeightOnlyConfig())
    with pytest.raises(ValueError, match=r"weights are quantized .*no aten.split.*load it unquantized for tp"):
        parallelize(model, ParallelConfig(tp=2))
    # the reason still holds: what DTensor would call on a quantized weight to split it, or to hold a slice of it
    weight = model.transformer_blocks[0].attn.to_q.weight
    for split_or_view in (lambda w: w.split(w.shape[0] // 2), lambda w: w.view(w.shape[0] // 2, -1)):
        with pytest.raises(NotImplementedError, match=r"Int8Tensor dispatch: .*unimplemented operator"):
            split_or_view(weight)
    model = tiny_transformer("flux")
    quantize_(model, Float8WeightOnlyConfig())
    weight = model.transformer_blocks[0].attn.to_q.weight
    with pytest.raises(AssertionError, match=r"Only support viewing with match dimensions"):
        weight.view(weight.shape[0] // 2, -1)


def test_xdit_lab_run_takes_tp(tmp_path):
    """`xdit-lab run --tp 2` on two ranks draws the images one rank draws alone (8-bit PNGs: within one level)."""
    import numpy as np
    from PIL import Image

    from xdit_lab.lessons import production
    from xdit_lab.testing import run_cli

    folder = save_tiny_pipeline("flux", tmp_path / "flux")
    kwargs = dict(tiny_pipeline_kwargs("flux"), num_inference_steps=2)
    images = {}
    for ranks, config in ((1, ParallelConfig()), (2, ParallelConfig(tp=2))):
        output = tmp_path / config.short()
        argv = production.run_argv(folder, ["a red cat"], config, output, **kwargs)
        assert ("--tp" in argv) == (config.tp > 1)
        job = run_cli(argv, ranks)
        assert job.codes == [0] * ranks, job
        images[config.tp] = np.asarray(Image.open(output / "000.png")).astype(int)
    assert np.abs(images[2] - images[1]).max() <= 1


def test_the_planner_gives_a_flux_dev_tp_rank_half_the_transformer(tmp_path):
    """FLUX.1-dev's headers (a header-only folder, no weights): under tp2·ulysses2 a rank holds 0.502 of the
    transformer's 23.8 GB in bfloat16, the rest of the pipeline whole, as load_pipeline will check it."""
    from xdit_lab.model_folder import read_model_folder
    from xdit_lab.plan.rows import plan_row
    from xdit_lab.real_models.header_only import save_header_only

    model = read_model_folder(save_header_only("FLUX.1-dev", tmp_path / "FLUX.1-dev"), torch.bfloat16)
    whole, split = plan_row(model, ParallelConfig(ulysses=4)), plan_row(model, ParallelConfig(tp=2, ulysses=2))
    assert 0.5 * whole.weights["transformer"] < split.weights["transformer"] <= 0.505 * whole.weights["transformer"]
    assert {k: v for k, v in split.weights.items() if k != "transformer"} == {
        k: v for k, v in whole.weights.items() if k != "transformer"
    }


def test_a_step_cache_under_tp_equals_diffusers_first_block_cache(tmp_path):
    """tp ranks hold the same tokens: the decision's all-reduced sums count each twice, their ratio the same; a
    skipped step's tp traffic is the first block's and the output modulation's (the closed form, told the skips)."""
    from test_step_cache import THRESHOLDS, _against_diffusers, _check, _reference

    folder = save_tiny_pipeline("flux", tmp_path / "flux")
    configs = [ParallelConfig(tp=2)]
    reference = _reference(folder, "flux", THRESHOLDS["flux"])
    runs = run_on_ranks(_against_diffusers, 2, folder, "flux", configs, THRESHOLDS["flux"], reference, timeout_s=300)
    _check(runs, configs, "flux", skipping=True)
    assert all("tp" in step["moved"] for rows in runs for step in rows[0]["traffic"])
