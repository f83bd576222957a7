"""PipeFusion: stages of blocks, patches, stale K/V; exact with warmup covering every step.

Every run above one rank also shows its traffic: the bytes each rank sent in each step, per group, equal
the closed form (xdit_lab.traffic.expected_bytes_per_step; tests/forward_traffic.py reads its sizes from a
transformer called outside a session)."""

import functools

import pytest
import torch
from forward_traffic import sample, session_traffic, traffic_mismatches, traffic_row

from xdit_lab import ParallelConfig, ParallelConfigError, RankMesh, comm_log, parallelize
from xdit_lab.families import MODULES, adapter_for
from xdit_lab.lab.measure import compare_to_serial
from xdit_lab.lessons.controls import wrong_stale_kv
from xdit_lab.loading import load_stage_transformer
from xdit_lab.models import parallel_state
from xdit_lab.sharding import patch_layout, patch_ranges, stage_ranges
from xdit_lab.testing import run_on_ranks
from xdit_lab.tiny import tiny_inputs, tiny_transformer

LAYERS, STEPS = 4, 3
DRIFT = 0.05  # how far the latents move per step, in units of their noise (about 4% of the output per step)


def _inputs(family):
    """STEPS transformer calls on latents that drift a little from step to step, as a diffusion's do:
    stale K/V (one step old) are then close to fresh ones, and a bound on staleness means something."""
    base = tiny_inputs(family, 4, height=8, width=8, seed=0, text_len=8 if family == "cogvideox" else 6)
    name, generator = MODULES[family].ADAPTER.latents_argument, torch.Generator().manual_seed(3)
    latents = base[name]
    if isinstance(latents, list):  # one tensor per sample (Z-Image's x)
        noise = [torch.randn(x.shape, generator=generator) for x in latents]
        return [dict(base, x=[x + DRIFT * i * n for x, n in zip(latents, noise)]) for i in range(STEPS)]
    noise = torch.randn(latents.shape, generator=generator)
    return [dict(base, **{name: latents + DRIFT * i * noise}) for i in range(STEPS)]


def _steps(config, family="pixart", control=None, extra=None, heads=None):
    """STEPS transformer calls (one per diffusion step), against diffusers' serial forward: per step the
    largest error, its 1e-4 bound, the relative L2 deviation, and the bytes sent beside the closed form.
    `control` names deliberately wrong stale K/V buffers (xdit_lab.lessons.controls); `extra(model, whole)`, a
    module-level function, adds what it reads of the parallel model after the steps (`whole`: the serial model's
    parameter bytes) under "extra"; `heads` sets the tiny model's (None: its own)."""
    model = tiny_transformer(family, layers=LAYERS, heads=heads)
    per_block = [sum(p.numel() for p in block.parameters()) for block in adapter_for(model).blocks(model)]
    whole_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    inputs = _inputs(family)
    with torch.no_grad():
        reference = [sample(model(**x)) for x in inputs]
    rows = []
    with torch.no_grad():
        model = parallelize(model, config, controls=wrong_stale_kv(control))
        for step, (x, ref) in enumerate(zip(inputs, reference)):
            with comm_log() as log:
                out = sample(model(**x))
            rows.append(
                dict(
                    error=(out - ref).abs().max().item(),
                    bound=1e-4 * max(1.0, ref.abs().max().item()),
                    relative_l2=((out - ref).norm() / ref.norm()).item(),
                    records=log.summary(),
                    **traffic_row(model, x, log, step),
                )
            )
    stage = parallel_state(model).strategy
    return dict(
        rows=rows,
        staleness=stage.report().staleness,
        block_params=sum(p.numel() for block in adapter_for(model).blocks(model) for p in block.parameters()),
        whole=sum(per_block),
        per_block=per_block,
        extra=None if extra is None else extra(model, whole_bytes),
    )


HYBRIDS = [
    ParallelConfig(pipefusion=2),
    ParallelConfig(pipefusion=2, num_patches=4),
    ParallelConfig(pipefusion=4),
    ParallelConfig(pipefusion=2, ulysses=2),
    ParallelConfig(pipefusion=2, ring=2),
    ParallelConfig(pipefusion=2, cfg=2),
    ParallelConfig(pipefusion=2, dp=2),
]


@pytest.mark.parametrize("config", HYBRIDS, ids=lambda c: c.short() + f"·patches{c.patches}")
def test_warmup_over_every_step_equals_serial(config):
    config = config.replace(warmup_steps=STEPS)
    for rank, out in enumerate(run_on_ranks(_steps, config.world_size, config, timeout_s=180)):
        for step, row in enumerate(out["rows"]):
            assert row["error"] <= row["bound"], f"rank {rank} step {step}: {row['error']:.3g}"
        assert not traffic_mismatches(out["rows"], f"rank {rank}"), traffic_mismatches(out["rows"], f"rank {rank}")
        # a stage holds its blocks only: about P/N of the blocks' parameters
        assert out["block_params"] * config.pipefusion == out["whole"]


def test_stale_steps_deviate_and_are_recorded():
    """With warmup 1, steps after the first read K/V one step old: the result moves away from
    serial (staleness is real), each patch's slice records the step that wrote it."""
    config = ParallelConfig(pipefusion=2, num_patches=2, warmup_steps=1)
    for rank, out in enumerate(run_on_ranks(_steps, 2, config)):
        errors = [row["error"] for row in out["rows"]]
        assert errors[0] <= out["rows"][0]["bound"]  # the warmup step is exact
        assert all(e > out["rows"][i + 1]["bound"] for i, e in enumerate(errors[1:]))  # stale afterwards
        assert not traffic_mismatches(out["rows"], f"rank {rank}"), traffic_mismatches(out["rows"], f"rank {rank}")
        written = out["staleness"]["written_step"]
        assert written and all(steps == [STEPS - 1, STEPS - 1] for steps in written.values())


# How far stale PipeFusion (pipefusion 2, 2 patches, 1 warmup step) moves a tiny model's output from
# diffusers' serial forward: the relative L2 of each stale step, on latents drifting DRIFT per step (_inputs).
# Each bound is 1.25 × the figure measured here (torch 2.13 CPU; the runs are deterministic), and
# both deliberately wrong buffers (xdit_lab.lessons.controls) are run against it: zeros for the stale K/V
# (10 to 70 times the real figure) and the subtle one, each patch reading its own K/V from the step before
# ("read before write", 1.6 to 2.1 times the real figure, so 1.25 separates them). Measured, real / read
# before write / zeros: dit 1.33e-3 / 2.81e-3 / 9.0e-2; sd3 3.4e-4 / 6.0e-4 / 1.6e-2; flux 7.5e-4 / 1.3e-3 /
# 1.8e-2; flux2 2.8e-4 / 4.8e-4 / 5.6e-3; qwenimage 8.3e-4 / 1.6e-3 / 1.4e-2; hunyuanvideo 1.15e-3 / 1.84e-3 /
# 1.8e-2; cogvideox 3.5e-4 / 5.9e-4 / 1.6e-2; wan 1.5e-3 / 2.5e-3 / 2.5e-2; zimage 1.10e-2 / 2.5e-2 / 1.7e-1 (its
# 16 padding tokens, alike, sit in the last patch: 3/4 of the image's K/V are stale when patch 0 runs).
STALE_L2 = dict(
    dit=1.33e-3,
    sd3=3.4e-4,
    flux=7.5e-4,
    flux2=2.8e-4,
    qwenimage=8.3e-4,
    hunyuanvideo=1.15e-3,
    cogvideox=3.5e-4,
    wan=1.5e-3,
    zimage=1.10e-2,
)
STALE_MARGIN = 1.25
CONTROLS = ("zeros", "read before write")


def _stale_deviation(run) -> float:
    """The largest relative L2 from serial over the steps after the warmup step."""
    return max(row["relative_l2"] for row in run["rows"][1:])


def _check_stale_bound(family, stale, controls, where):
    """Stale within STALE_MARGIN × its measured figure, every control beyond it; all traffic as closed."""
    bound = STALE_MARGIN * STALE_L2[family]
    deviation = _stale_deviation(stale)
    assert 1e-5 < deviation <= bound, f"{where}: stale {deviation:.3g} > bound {bound:.3g}"
    for kind, run in controls.items():
        assert _stale_deviation(run) > bound, (
            f"{where}: control {kind!r} {_stale_deviation(run):.3g} within {bound:.3g}"
        )
        assert not traffic_mismatches(run["rows"], f"{where} {kind}")  # a wrong buffer moves the same bytes


def _dit_exact_and_stale():
    stale = ParallelConfig(pipefusion=2, warmup_steps=1)
    return dict(
        exact=_steps(ParallelConfig(pipefusion=2, warmup_steps=STEPS), "dit"),
        stale=_steps(stale, "dit"),
        controls={kind: _steps(stale, "dit", control=kind) for kind in CONTROLS},
    )


def test_pipefusion_on_dit():
    """A tiny DiTTransformer2DModel under PipeFusion 2: equal to diffusers' own forward run serially
    when every step is a warmup step (the last stage conditions DiT's output layer with block 0's
    embedding, as the whole model does); after warmup 1 the steps read stale K/V, deviate within
    their measured bound while both wrong buffers exceed it, and the buffers record it (patch 0 read
    patch 1's K/V from the step before). Bytes per step equal the closed form in every run."""
    for rank, runs in enumerate(run_on_ranks(_dit_exact_and_stale, 2)):
        exact, stale = runs["exact"], runs["stale"]
        for step, row in enumerate(exact["rows"]):
            assert row["error"] <= row["bound"], f"rank {rank} step {step}: {row['error']:.3g}"
        for name, run in (("exact", exact), ("stale", stale)):
            assert not traffic_mismatches(run["rows"], f"{name} rank {rank}"), traffic_mismatches(run["rows"], name)
        assert stale["rows"][0]["error"] <= stale["rows"][0]["bound"]  # the warmup step
        assert all(row["error"] > row["bound"] for row in stale["rows"][1:])
        _check_stale_bound("dit", stale, runs["controls"], f"dit rank {rank}")
        last = STEPS - 1
        for reads in stale["staleness"]["reads"].values():
            assert [(a, list(b), list(c)) for a, b, c in reads] == [
                (last, [0], [last, last - 1]),
                (last, [1], [last, last]),
            ]


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
            # the package's closed form says the same, and nothing else moved
            assert (
                row["moved"]
                == row["expected"]
                == {"pipefusion": batch * tokens * hidden * 4 if rank == 0 else noise_bytes}
            )


def test_stage_and_patch_splits():
    assert stage_ranges(28, 4) == [(0, 7), (7, 14), (14, 21), (21, 28)]
    assert stage_ranges(5, 2) == [(0, 3), (3, 5)]
    assert stage_ranges(5, 2, split=[1, 4]) == [(0, 1), (1, 5)]
    with pytest.raises(ValueError, match="at least one of the 5 blocks"):
        stage_ranges(5, 2, split=[5, 0])
    assert patch_ranges(4, 4, 2) == [(0, 8), (8, 16)]
    assert patch_ranges(4, 4, 2, padded=16) == [(0, 8), (8, 32)]  # Z-Image's padding to 32 follows the last row
    with pytest.raises(ValueError, match="5 patches are more than the 4 token rows"):
        patch_ranges(4, 4, 5)


def test_patches_of_several_images_are_bands_of_each():
    """A 2 × 2 drawn grid (tokens 0-3), then reference images of 3 × 2 (4-9) and 4 × 1 (10-13): 2 patches, each a
    band of every image (patch 0: 0-1, 4-7, 10-11; patch 1: 2-3, 8-9, 12-13), each cut over 2 sp ranks in that
    order; every token held once, and the gather puts each back at its place."""
    layout = patch_layout((2, 2), 2, 2, appended=((3, 2), (4, 1)))
    assert layout.patches == [(0, 8), (8, 14)]
    pieces = {(p, rank): layout.rank_tokens([p], rank).tolist() for p in (0, 1) for rank in (0, 1)}
    assert pieces == {(0, 0): [0, 1, 4, 5], (0, 1): [6, 7, 10, 11], (1, 0): [2, 3, 8], (1, 1): [9, 12, 13]}
    assert sorted(layout.gather_order([0, 1]).tolist()) == list(range(14))
    assert layout.rank_sizes([0, 1]) == [7, 7]
    assert layout.rank_ranges(0, 1) == [(6, 8), (10, 12)] and layout.rank_ranges(1, 0) == [(2, 4), (8, 9)]
    one = patch_layout((4, 4), 2, 2)  # one image: the bands as patch_ranges cuts them, in the sequence's order
    assert (one.patches, one.order) == (patch_ranges(4, 4, 2), None)
    with pytest.raises(ValueError, match="3 patches are more than the 2 token rows"):
        patch_layout((4, 4), 3, 1, appended=((2, 8),))


def test_more_stages_than_blocks_is_refused():
    with pytest.raises(ParallelConfigError, match="2 transformer layers cannot fill 4 PipeFusion stages"):
        ParallelConfig(pipefusion=4).validate(4, num_layers=2)


def _pipeline_steps(folder, config):
    from diffusers import DiffusionPipeline

    from xdit_lab import load_pipeline
    from xdit_lab.tiny import tiny_pipeline_kwargs

    kwargs = dict(tiny_pipeline_kwargs("pixart"), num_inference_steps=4)
    reference = DiffusionPipeline.from_pretrained(folder)
    reference.set_progress_bar_config(disable=True)
    expected = reference(
        ["a red cat", "a dog"],
        negative_prompt=["", "photo"],
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
        **kwargs,
    ).images
    pipe = load_pipeline(folder, config, progress=False)
    session = pipe.session(["a red cat", "a dog"], negative_prompt=["", "photo"], seed=0, **kwargs)
    while not session.done:
        session.step()
    stepped = session.result(output_type="latent").images
    traffic = session_traffic(session)
    called = pipe(["a red cat", "a dog"], negative_prompt=["", "photo"], seed=0, output_type="latent", **kwargs).images
    error = (stepped - expected).abs().max().item()
    try:
        pipe("a cat", seed=0, height=4, width=16, **{k: v for k, v in kwargs.items() if k not in ("height", "width")})
        too_many_patches = None
    except ValueError as e:
        too_many_patches = str(e)
    return dict(
        error=error,
        bound=1e-4 * max(1.0, expected.abs().max().item()),
        same=torch.equal(stepped, called),
        plan=pipe.memory_plan.per_rank_bytes["transformer"],
        held=sum(t.numel() * t.element_size() for t in pipe.diffusers_pipeline.transformer.state_dict().values()),
        too_many_patches=too_many_patches,
        traffic=traffic,
    )


def test_pipeline_with_dpm_solver_through_session_and_call(tmp_path):
    """DPM-Solver (multistep) through DenoiseSession.step() and pipe(...): equal to diffusers' own
    pipeline when every step is a warmup step; each step's bytes equal the closed form."""
    from xdit_lab.tiny import save_tiny_pipeline

    folder = save_tiny_pipeline("pixart", tmp_path / "pixart")
    config = ParallelConfig(pipefusion=2, warmup_steps=4)
    for rank, out in enumerate(run_on_ranks(_pipeline_steps, 2, folder, config, timeout_s=180)):
        assert out["error"] <= out["bound"], out["error"]
        mismatches = traffic_mismatches(out["traffic"], f"rank {rank}")
        assert len(out["traffic"]) == 4 and not mismatches, mismatches
        assert out["same"]
        assert out["plan"] == out["held"]  # the plan: this stage's blocks and the shared embeddings, exactly
        assert "fewer than the 2 PipeFusion patches" in out["too_many_patches"]


def _stage_loading(folder):
    """A stage's weights as loaded against the file; then the same generation loaded normally and
    with mmap refused (plain reads of this stage's blocks, diffusers' retry for the other parts)."""
    import torch.distributed as dist

    from xdit_lab import load_pipeline
    from xdit_lab.lessons.loading import mmap_refused
    from xdit_lab.loading import read_tensors
    from xdit_lab.safetensors_io import read_safetensors_header
    from xdit_lab.tiny import tiny_pipeline_kwargs

    config = ParallelConfig(pipefusion=2, warmup_steps=1)
    pipe = load_pipeline(folder, config, progress=False)
    transformer = pipe.diffusers_pipeline.transformer
    file = next((folder / "transformer").glob("*.safetensors"))
    keys = [k for k in read_safetensors_header(file) if k.startswith(f"transformer_blocks.{dist.get_rank()}.")]
    on_disk = read_tensors(file, keys)
    loaded = dict(transformer.transformer_blocks[0].named_parameters())
    same = all(torch.equal(on_disk[k], loaded[k.split(".", 2)[2]]) for k in keys)
    kwargs = dict(tiny_pipeline_kwargs("pixart"), num_inference_steps=3)
    session = pipe.session("a red cat", seed=0, **kwargs).run()
    normal = session.result(output_type="latent").images
    with mmap_refused() as refusals:
        refused_pipe = load_pipeline(folder, config, progress=False)
    refused = refused_pipe("a red cat", seed=0, output_type="latent", **kwargs).images
    return dict(
        blocks=len(transformer.transformer_blocks),
        same=same,
        refusals=dict(refusals),
        latents_equal=torch.equal(normal, refused),
        latents_spread=normal.std().item(),
        block_bytes=sum(p.numel() * 4 for p in transformer.transformer_blocks.parameters()),
        traffic=session_traffic(session),
    )


@pytest.fixture(scope="module")
def stage_loading(tmp_path_factory):
    from xdit_lab.tiny import save_tiny_pipeline

    folder = save_tiny_pipeline("pixart", tmp_path_factory.mktemp("pixart"))
    return run_on_ranks(_stage_loading, 2, folder, timeout_s=180)


def test_each_stage_materialises_only_its_blocks(stage_loading):
    assert [o["blocks"] for o in stage_loading] == [1, 1]  # the tiny model has 2 blocks: one per stage
    assert all(o["same"] for o in stage_loading)  # stage r holds block r's weights as saved
    for rank, o in enumerate(stage_loading):  # and it generates, each step's bytes as the closed form says
        assert len(o["traffic"]) == 3 and not traffic_mismatches(o["traffic"], f"rank {rank}")


def test_plain_reads_when_mmap_is_refused(stage_loading, tmp_path):
    """A file system that refuses mmap: a stage's blocks come by plain reads at the header's offsets
    (shard_loading: never mapped, so never refused), the other parts by diffusers' retry, and the
    stale-K/V generation is the same, bit for bit."""
    from safetensors.torch import save_file

    from xdit_lab.lessons.loading import mmap_refused
    from xdit_lab.loading import read_tensors

    for o in stage_loading:
        assert o["refusals"]["safe_open"] == 0 and o["refusals"]["load_file"] > 0  # refused only where mapped
        assert o["latents_equal"] and o["latents_spread"] > 0  # and changed nothing
    tensors = {"a": torch.randn(3, 4), "b": torch.arange(5), "c": torch.randn(2).to(torch.bfloat16)}
    save_file(tensors, tmp_path / "w.safetensors")
    with mmap_refused() as refusals:
        read = read_tensors(tmp_path / "w.safetensors", ["a", "c", "b"])
    assert refusals["safe_open"] == 1
    assert all(torch.equal(read[k], tensors[k]) for k in tensors)


def _uneven_split():
    model = tiny_transformer("pixart", layers=LAYERS)
    inputs = tiny_inputs("pixart", 2, height=8, width=8)
    with torch.no_grad():
        reference = model(**inputs).sample
        model = parallelize(model, ParallelConfig(pipefusion=2, warmup_steps=5, stage_split=[1, 3]))
        with comm_log() as log:
            error = (model(**inputs).sample - reference).abs().max().item()
    return len(model.transformer_blocks), error, traffic_row(model, inputs, log, 0)


def test_stage_split_can_be_overridden():
    results = run_on_ranks(_uneven_split, 2)
    assert [blocks for blocks, _, _ in results] == [1, 3]
    assert all(error < 1e-4 for _, error, _ in results)
    assert not traffic_mismatches([traffic for _, _, traffic in results])  # a step each: rank 0's, rank 1's


# PipeFusion's deviation from serial on the bundled model (relative L2 of the final latents, against
# diffusers' own pipeline run serially). benchmarks/digits_quality.py measured, on 100 digits (10 per
# digit, 20 DPM-Solver++ steps), for pipefusion 2 with 1 warmup step and 2 patches: 0.0155, the classifier
# reading 100% of the digits; and, with deliberately wrong buffers (xdit_lab.lessons.controls), 0.124 with
# zeros where the stale K/V belong and 0.057 with each patch reading its own K/V from the step before
# ("read before write"). Here (torch 2.13 CPU), on 20 digits (2 seeds each): real 0.0122, read before
# write 0.063, zeros 0.094; on 10 digits (seed 0), as the controls now run: read before write 0.0420,
# zeros 0.0981, the same without ring and under ring 2 (real 0.0126 there).
# The bound sits between the real figure (2.4× below it) and the subtler control (1.4× above it on the
# ten digits), so both controls are run against it and must exceed it. (It was 0.05, which the subtler
# control passed on ten digits.)
STALE_BOUND = 0.03
DIGIT_CONTROLS = ("zeros", "read before write")


def _digits(config, per_digit, controls=()):
    """On a rank of `config`: per_digit images of each digit (seeds 0..per_digit-1, one generator each,
    the folder's own call defaults) drawn with PipeFusion's own buffers, then under each control's
    deliberately wrong ones, one image per digit (seed 0: ten digits show a control past the bound; CI
    time): the final latents, what the classifier reads (own buffers) and each step's bytes beside the
    closed form."""
    from xdit_lab import load_pipeline
    from xdit_lab.digits import prompt_for
    from xdit_lab.digits.classifier import classify

    runs = {}
    for control in (None, *controls):
        per = per_digit if control is None else 1
        digits = [d for d in range(10) for _ in range(per)]
        pipe = load_pipeline("digits", config, mesh=RankMesh(config), progress=False, controls=wrong_stale_kv(control))
        generators = [torch.Generator().manual_seed(s) for _ in range(10) for s in range(per)]
        session = pipe.session([prompt_for(d) for d in digits], generator=generators).run()
        runs[control] = dict(latents=session.latents.clone(), digits=digits, traffic=session_traffic(session))
        if control is None:
            runs[None]["read"] = classify(session.result(output_type="np").images).tolist()
        pipe.close()
    return runs


def _relative_l2(latents, serial):
    return compare_to_serial(latents, serial)["relative_l2"]


@pytest.fixture(scope="module")
def digits_serial():
    """20 digits (2 seeds each) drawn by diffusers' own pipeline, serially, as _digits draws them."""
    from diffusers import DiffusionPipeline

    from xdit_lab.digits import DIGITS_DIR, call_kwargs, prompt_for

    reference = DiffusionPipeline.from_pretrained(DIGITS_DIR)
    reference.set_progress_bar_config(disable=True)
    generators = [torch.Generator().manual_seed(s) for _ in range(10) for s in range(2)]
    prompts = [prompt_for(d) for d in range(10) for _ in range(2)]
    return reference(prompts, generator=generators, **call_kwargs(output_type="latent")).images


@pytest.fixture(scope="module")
def digits_pipefusion():
    config = ParallelConfig(pipefusion=2, num_patches=2, warmup_steps=1)
    return run_on_ranks(_digits, 2, config, 2, DIGIT_CONTROLS, timeout_s=240)


def _check_digits_traffic(ranks, where):
    for rank, runs in enumerate(ranks):
        for control, run in runs.items():
            mismatches = traffic_mismatches(run["traffic"], f"{where} {control or 'own buffers'} rank {rank}")
            assert len(run["traffic"]) == 20 and not mismatches, mismatches  # the folder's 20 steps


def test_stale_kv_on_the_digits_model_stays_close_to_serial(digits_serial, digits_pipefusion):
    """PipeFusion 2 with 2 patches and 1 warmup step on the bundled model, 20 digits: stale (not
    exact) and within STALE_BOUND of diffusers' serial run, while both controls (zeros for the stale
    K/V; each patch reading its own K/V a step old; ten digits each) are not; every step's bytes as the
    closed form."""
    staged = digits_pipefusion[0][None]
    deviation = _relative_l2(staged["latents"], digits_serial)
    assert 1e-4 < deviation < STALE_BOUND, deviation
    for control in DIGIT_CONTROLS:  # one image per digit, seed 0: every other image of the serial run
        wrong = _relative_l2(digits_pipefusion[0][control]["latents"], digits_serial[::2])
        assert wrong > STALE_BOUND, f"control {control!r}: {wrong:.3g} within {STALE_BOUND}"
    accuracy = sum(r == d for r, d in zip(staged["read"], staged["digits"])) / len(staged["digits"])
    assert accuracy >= 0.9
    _check_digits_traffic(digits_pipefusion, "pf2")


def test_stale_kv_under_ring(digits_serial, digits_pipefusion):
    """PipeFusion 2 × Ring 2, 1 warmup step: every ring rank holds its part of every patch's stale
    K/V and the buffers travel the ring. Ring is exact, so the result is PipeFusion 2's alone
    (the same stale schedule) within 1e-4, hence within STALE_BOUND of serial; every rank's bytes per
    step (ring and pipefusion) equal the closed form. The control, the subtler wrong buffer (each patch
    reading its own K/V a step old) under ring, is neither within 1e-4 of PipeFusion 2 alone nor within
    STALE_BOUND. (The zeros control is run against STALE_BOUND above, without ring: here it would only
    repeat that claim, at the cost of one more 4-rank run of ten digits.)"""
    config = ParallelConfig(pipefusion=2, ring=2, num_patches=2, warmup_steps=1)
    control = "read before write"
    ranks = run_on_ranks(_digits, 4, config, 1, [control], timeout_s=240)
    ringed = ranks[0][None]
    # per_digit 1 draws digit d with seed 0: every other image of the per_digit 2 runs (one generator each)
    serial, alone = digits_serial[::2], digits_pipefusion[0][None]["latents"][::2]
    assert ringed["digits"] == list(range(10))
    assert compare_to_serial(ringed["latents"], alone)["max_relative"] < 1e-4
    assert 1e-4 < _relative_l2(ringed["latents"], serial) < STALE_BOUND
    assert compare_to_serial(ranks[0][control]["latents"], alone)["max_relative"] > 1e-4, control
    assert _relative_l2(ranks[0][control]["latents"], serial) > STALE_BOUND, control
    _check_digits_traffic(ranks, "pf2·ring2")
    assert all({"ring", "pipefusion"} <= set(rank[None]["traffic"][-1]["moved"]) for rank in ranks)


def test_memory_plan_counts_the_largest_stage_and_the_shared_tensors():
    from xdit_lab.digits import DIGITS_DIR
    from xdit_lab.plan import plan_memory, tensor_bytes
    from xdit_lab.safetensors_io import read_safetensors_header

    header = read_safetensors_header(DIGITS_DIR / "transformer" / "diffusion_pytorch_model.safetensors")
    sizes = {key: tensor_bytes(info, torch.float32) for key, info in header.items()}
    blocks = [sum(v for k, v in sizes.items() if k.startswith(f"transformer_blocks.{i}.")) for i in range(4)]
    shared = sum(sizes.values()) - sum(blocks)
    assert min(blocks) > 0 and shared > 0
    even = plan_memory(DIGITS_DIR, ["transformer"], dtype=torch.float32, config=ParallelConfig(pipefusion=2))
    assert even.per_rank_bytes["transformer"] == shared + blocks[0] + blocks[1]
    split = ParallelConfig(pipefusion=2, stage_split=[1, 3])
    uneven = plan_memory(DIGITS_DIR, ["transformer"], dtype=torch.float32, config=split)
    assert uneven.per_rank_bytes["transformer"] == shared + sum(blocks[1:])  # the larger stage is planned


def test_a_refused_plan_suggests_only_pipefusion_degrees_that_exist_and_fit():
    """check_plan's advice on the digits transformer (4 blocks, float32): a limit the weights fit
    with 4 stages but not with 3 suggests pipefusion 4, and its figure counts what every stage keeps
    outside the blocks; a limit below even one block per stage says PipeFusion alone cannot fit it,
    and no advice names a degree above the 4 blocks."""
    import re

    from xdit_lab.digits import DIGITS_DIR
    from xdit_lab.plan import MemoryPlanError, check_plan, human_bytes, plan_memory, tensor_bytes
    from xdit_lab.safetensors_io import read_safetensors_header

    header = read_safetensors_header(DIGITS_DIR / "transformer" / "diffusion_pytorch_model.safetensors")
    sizes = {key: tensor_bytes(info, torch.float32) for key, info in header.items()}
    blocks = [sum(v for k, v in sizes.items() if k.startswith(f"transformer_blocks.{i}.")) for i in range(4)]
    shared = sum(sizes.values()) - sum(blocks)
    plan = plan_memory(DIGITS_DIR, ["transformer"], dtype=torch.float32)
    four_stages, three_stages = shared + max(blocks), shared + max(blocks[0] + blocks[1], blocks[2], blocks[3])
    assert four_stages < three_stages

    def advice(limit):
        with pytest.raises(MemoryPlanError) as refused:
            check_plan(plan, torch.device("cpu"), limit_bytes=limit, config=ParallelConfig())
        return str(refused.value)

    fits_four = advice(four_stages)
    assert f"pipefusion 4 holds {human_bytes(four_stages)}" in fits_four, fits_four
    assert f"{human_bytes(shared)} outside the blocks on every stage" in fits_four
    too_small = advice(four_stages - 1)
    assert "PipeFusion alone does not fit it: even pipefusion 4" in too_small, too_small
    for message in (fits_four, too_small):
        assert max(int(n) for n in re.findall(r"pipefusion (\d+)", message)) <= 4


def _planned_and_held_kv(folder, configs, prompts):
    from xdit_lab import load_pipeline
    from xdit_lab.models import parallel_state
    from xdit_lab.tiny import tiny_pipeline_kwargs

    rows = []
    for config in configs:
        pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False)
        kwargs = dict(tiny_pipeline_kwargs("pixart"), num_inference_steps=2)
        planned = pipe.memory_plan_for(len(prompts), **kwargs).activation_bytes["stale K/V"][1]
        strategy = parallel_state(pipe.diffusers_pipeline.transformer).strategy
        held, traffic = {}, []
        for batch in (list(prompts), prompts[0]):  # the request's plan; the load's plan (one prompt)
            session = pipe.session(batch, seed=0, **kwargs).step()
            held[len(batch) if isinstance(batch, list) else 1] = sum(
                t.numel() * t.element_size() for b in strategy.buffers.values() for t in (b.keys, b.values)
            )
            traffic += session_traffic(session)
        at_load = pipe.memory_plan.activation_bytes["stale K/V"][1]
        rows.append(
            dict(
                config=config.short(),
                planned=planned,
                held=held[len(prompts)],
                at_load=at_load,
                one=held[1],
                traffic=traffic,
            )
        )
    return rows


def test_the_plan_for_a_request_counts_the_kv_buffers_a_stage_holds(tmp_path):
    """pipe.memory_plan_for(prompts): the K/V buffers each stage holds after a step, planned before the
    step from the stage's blocks, heads, patches and batch rows, equal to the bytes of the buffers it
    really allocated (three prompts, both CFG branches: 6 rows, split by cfg and unevenly by dp); and
    load_pipeline's own plan, made from the configs and headers before loading, equal to what one
    prompt at the default size leaves."""
    from xdit_lab.tiny import save_tiny_pipeline

    folder = save_tiny_pipeline("pixart", tmp_path / "pixart")
    prompts = ("a red cat", "a blue dog", "a green car")
    cases = {
        2: [ParallelConfig(pipefusion=2), ParallelConfig(pipefusion=2, num_patches=4)],
        4: [
            ParallelConfig(pipefusion=2, ulysses=2),
            ParallelConfig(pipefusion=2, ring=2),
            ParallelConfig(pipefusion=2, cfg=2),
            ParallelConfig(pipefusion=2, dp=2),
            ParallelConfig(pipefusion=2, tp=2),  # a tp rank keeps the K/V of its heads: half the stage's
        ],
    }
    for world_size, configs in cases.items():
        for rank, rows in enumerate(run_on_ranks(_planned_and_held_kv, world_size, folder, configs, prompts)):
            for row in rows:
                assert row["held"] > 0 and row["planned"] == row["held"], f"{row['config']} rank {rank}: {row}"
                assert row["one"] > 0 and row["at_load"] == row["one"], f"{row['config']} rank {rank}: {row}"
                where = f"{row['config']} rank {rank}"  # the step of each request: its bytes as the closed form says
                assert len(row["traffic"]) == 2 and not traffic_mismatches(row["traffic"], where), row["traffic"]


# ---- joint-attention families: the text states travel with every patch --------------------------------------
# SD3, Flux and CogVideoX change their text tokens in every block: a stage hands the next one the text
# states its blocks produced with each patch; rotary rows follow the patches. Each world size is one spawned
# run over every family and configuration (CI time).

# Wan: image-only rotary; Z-Image: its image refiner's blocks, then its main layers over [image; caption]
JOINT = ("sd3", "flux", "flux2", "qwenimage", "hunyuanvideo", "cogvideox", "wan", "zimage")
JOINT_STAGES = {
    "sd3": [(0, 2), (2, 4)],
    "qwenimage": [(0, 2), (2, 4)],
    "hunyuanvideo": [(0, 3), (3, 6)],
    "flux": [(0, 3), (3, 6)],
    "flux2": [(0, 3), (3, 6)],
    "cogvideox": [(0, 2), (2, 4)],
    "wan": [(0, 2), (2, 4)],
    "zimage": [(0, 3), (3, 5)],  # 1 refiner block and 4 layers: stage 0 hands on the patch and the caption
}
JOINT_CONFIGS = {
    2: [ParallelConfig(pipefusion=2), ParallelConfig(pipefusion=2, num_patches=4)],
    4: [
        ParallelConfig(pipefusion=2, ulysses=2),
        ParallelConfig(pipefusion=2, ring=2),
        ParallelConfig(pipefusion=2, cfg=2),  # not Flux, Flux.2, HunyuanVideo: guidance-distilled, no CFG batch
    ],
}


def _joint(world_size):
    runs = []
    for family in JOINT:
        for config in JOINT_CONFIGS[world_size]:
            if family in ("flux", "flux2", "hunyuanvideo") and config.cfg > 1:
                continue
            for warmup in (STEPS, 1) if world_size == 2 else (STEPS,):  # 1: stale steps after the first
                config = config.replace(warmup_steps=warmup)
                run = dict(_steps(config, family), family=family, config=config, controls={})
                if warmup == 1 and config.patches == 2:  # the bound on staleness, and its wrong buffers
                    run["controls"] = {kind: _steps(config, family, control=kind) for kind in CONTROLS}
                runs.append(run)
    return runs


@functools.cache
def _joint_ranks(world_size):
    return run_on_ranks(_joint, world_size, world_size, timeout_s=600)


@pytest.mark.timeout(720)
@pytest.mark.parametrize("world_size", [2, 4])
def test_joint_families_equal_serial_when_every_step_warms_up(world_size):
    """pf2, pf2 with 4 patches, pf2·u2, pf2·r2, pf2·cfg2: every step within 1e-4 of diffusers' serial
    forward, each step's bytes per group equal to the closed form (every group above 1 moving some), and
    each stage holds exactly its own blocks (Flux's double-stream blocks are larger than its single-stream
    ones, so "half" is of the stack, by block)."""
    for rank, runs in enumerate(_joint_ranks(world_size)):
        exact = [r for r in runs if r["config"].warmup_steps == STEPS]
        assert len(exact) == {2: 16, 4: 21}[world_size]  # families × configurations (some without cfg)
        for run in exact:
            config = run["config"]
            where = f"{run['family']} {config.short()} patches {config.patches} rank {rank}"
            for step, row in enumerate(run["rows"]):
                assert row["error"] <= row["bound"], f"{where} step {step}: {row['error']:.3g}"
                degrees = {g for g in ("ulysses", "ring", "pipefusion", "cfg") if getattr(config, g) > 1}
                assert degrees <= set(row["expected"]), f"{where}: the closed form moves nothing in {degrees}"
            assert not traffic_mismatches(run["rows"], where), traffic_mismatches(run["rows"], where)
            stage = rank // (config.ulysses * config.ring) % 2  # ulysses varies fastest, then ring, then pipefusion
            start, stop = JOINT_STAGES[run["family"]][stage]
            assert run["block_params"] == sum(run["per_block"][start:stop]), where


def test_joint_stale_steps_deviate_and_hand_text_with_every_patch():
    """Warmup 1: the first step is exact, later steps read one-step-old image K/V and move away from
    serial (staleness is measured, not hidden): with 2 patches within each family's measured bound
    (STALE_L2), which both wrong buffers exceed. Stage 0 sends, per patch run, the patch's image tokens
    and the whole text: B × (S + runs × T) × hidden × 4 bytes per step, in 2 messages per run (Wan,
    whose blocks return the image only: 1 message, no text); every rank's bytes per step equal the
    package's closed form too. Z-Image's 16 image tokens are padded to 32 (the padding goes with the last patch)
    and its captions (6, 37, 4 and 38 tokens) each to a multiple of 32, the batch to the longest: 64."""
    batch = 4
    # 8 × 8 latent pixels: Flux's are not patchified, Qwen-Image packs 2 × 2
    image = {"sd3": 16, "flux": 64, "flux2": 64, "qwenimage": 16, "hunyuanvideo": 2 * 16, "cogvideox": 3 * 16}
    image |= {"wan": 2 * 16, "zimage": 32}
    text = {"sd3": 6, "flux": 6, "flux2": 6, "qwenimage": 6, "hunyuanvideo": 6, "cogvideox": 8, "wan": 0}  # Wan's: none
    text["zimage"] = 64
    for rank, runs in enumerate(_joint_ranks(2)):
        stale = [r for r in runs if r["config"].warmup_steps == 1]
        assert len(stale) == 16
        for run in stale:
            family, config, rows = run["family"], run["config"], run["rows"]
            where = f"{family} patches {config.patches} rank {rank}"
            assert rows[0]["error"] <= rows[0]["bound"], where
            assert all(row["error"] > row["bound"] for row in rows[1:]), where
            assert not traffic_mismatches(rows, where), traffic_mismatches(rows, where)
            if config.patches == 2:
                _check_stale_bound(family, run, run["controls"], where)
            hidden = MODULES[family].TINY.heads * 16  # the tiny models' heads of 16
            for step, row in enumerate(rows):
                sends = [r for r in row["records"] if r["group"] == "pipefusion" and r["op"] == "send"]
                runs_per_step = 1 if step == 0 else config.patches
                expected = batch * (image[family] + runs_per_step * text[family]) * hidden * 4
                assert sum(r["bytes"] for r in sends) == (expected if rank == 0 else 0), f"{where} step {step}"
                assert len(sends) == ((2 if text[family] else 1) * runs_per_step if rank == 0 else 0), where


def _flux2_splits():
    return [
        _steps(ParallelConfig(pipefusion=2, warmup_steps=STEPS, stage_split=split), "flux2")
        for split in ([4, 2], [5, 1])
    ]


def test_flux2_stages_hand_over_its_joined_single_stream_tokens():
    """Flux.2's single-stream blocks take [text; image] as one tensor. A stage boundary at the switch
    (4 double-stream blocks | 2 single-stream) makes the receiving stage join the text and image it
    receives; one inside the single-stream blocks (4 + 1 | 1) makes the sending stage split them.
    Both equal diffusers' serial forward within 1e-4 at every step, the bytes as the closed form says."""
    for rank, runs in enumerate(run_on_ranks(_flux2_splits, 2, timeout_s=300)):
        for split, run in zip(("4 | 2", "5 | 1"), runs):
            for step, row in enumerate(run["rows"]):
                assert row["error"] <= row["bound"], f"split {split} rank {rank} step {step}: {row['error']:.3g}"
            assert not traffic_mismatches(run["rows"], f"split {split} rank {rank}")


def _zimage_splits():
    return [
        _steps(ParallelConfig(pipefusion=2, warmup_steps=STEPS, stage_split=split), "zimage")
        for split in ([1, 4], [2, 3])
    ]


def test_zimage_stages_join_the_caption_where_its_forward_joins_it():
    """Z-Image's stack is its image refiner's block, then its 4 main layers over [image; caption]. A stage boundary
    at the switch (1 | 4) hands on the patch's image states alone, and the receiving stage joins its own caption (its
    caption refiner runs whole, reading no image token); one inside the layers (2 | 3) hands on the caption states
    with each patch. Both equal diffusers' serial forward within 1e-4 at every step, the bytes as the closed form
    says: one message per patch run at the switch, two inside the layers."""
    for rank, runs in enumerate(run_on_ranks(_zimage_splits, 2, timeout_s=300)):
        for split, run in zip(("1 | 4", "2 | 3"), runs):
            for step, row in enumerate(run["rows"]):
                assert row["error"] <= row["bound"], f"split {split} rank {rank} step {step}: {row['error']:.3g}"
                sends = [r for r in row["records"] if r["group"] == "pipefusion" and r["op"] == "send"]
                assert len(sends) == ({"1 | 4": 1, "2 | 3": 2}[split] if rank == 0 else 0), (split, rank, sends)
            assert not traffic_mismatches(run["rows"], f"split {split} rank {rank}")


def _skip_layers():
    model = parallelize(tiny_transformer("sd3", layers=LAYERS), ParallelConfig(pipefusion=2))
    try:
        with torch.no_grad():
            model(**_inputs("sd3")[0], skip_layers=[1])
    except NotImplementedError as error:
        return str(error)


def test_arguments_that_index_blocks_are_refused_by_name():
    """SD3's skip_layers (skip-layer guidance) counts blocks in the forward's loop, which on a stage
    starts at its own first block: refused, not run on the wrong blocks."""
    for message in run_on_ranks(_skip_layers, 2, timeout_s=120):
        assert message and "skip_layers" in message and "without PipeFusion" in message, message


def test_a_stage_loads_only_its_blocks_of_both_flux_lists(tmp_path):
    """load_stage_transformer on a saved Flux transformer: stage (3, 6) materialises double-stream
    block 3 and both single-stream blocks, with the saved weights, named in its own lists."""
    model = tiny_transformer("flux", layers=LAYERS)
    model.save_pretrained(tmp_path)
    stage = load_stage_transformer(tmp_path, "FluxTransformer2DModel", (3, 6), torch.float32, "cpu")
    assert (len(stage.transformer_blocks), len(stage.single_transformer_blocks)) == (1, 2)
    pairs = [("transformer_blocks.0", "transformer_blocks.3")] + [
        (f"single_transformer_blocks.{i}", f"single_transformer_blocks.{i}") for i in range(2)
    ]
    for mine, theirs in pairs:
        theirs_params = dict(model.get_submodule(theirs).named_parameters())
        for name, tensor in stage.get_submodule(mine).named_parameters():
            assert torch.equal(tensor, theirs_params[name]), f"{mine}.{name}"
    assert torch.equal(stage.x_embedder.weight, model.x_embedder.weight)
