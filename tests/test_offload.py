"""load_pipeline(folder, config, offload_blocks=N): the transformer in host memory, N blocks at a time on the device,
with diffusers' own group offloading applied after parallelize (models/offload.py).

On 2 ranks, the tiny Flux and Wan pipelines serially, under ulysses 2 and under PipeFusion 2 (every step warm, and
with stale K/V), each loaded with and without offloaded blocks. For every run:
  - the latents equal the same strategy's without offloading, bit for bit, and (where the strategy is exact)
    diffusers' own pipeline run serially within 1e-4 relative;
  - diffusers' hooks are on the model (its registry's "group_offloading" on each group's modules), grouped N blocks
    at a time, and a PipeFusion stage's groups hold only the blocks of its stage; the load without offloading has
    none (the control);
  - the load's plan holds on the device exactly the root's group and the largest group diffusers made (their bytes,
    read from its groups), and the bytes the planner says cross from the host per step equal the groups' bytes
    times the calls of their leading modules in the last step (one call each under sequence shards, one per patch
    for a stage's blocks: diffusers onloads a group when its first module runs).
On a machine without an accelerator the device is the CPU, so diffusers moves each group from the CPU to the CPU:
every hook runs, but that the parameters leave the device between steps cannot be seen here (a GPU run would).
"""

import re

import pytest
import torch

from xdit_lab import ParallelConfig, RankMesh, load_pipeline
from xdit_lab.lessons.families import output_latents
from xdit_lab.model_folder import read_model_folder
from xdit_lab.models import offload_groups, unparallelize
from xdit_lab.plan import plan_row
from xdit_lab.testing import run_on_ranks
from xdit_lab.tiny import save_tiny_pipeline, tiny_pipeline_kwargs

PROMPTS = ["a red cat"]
STEPS = 3
# (family, configuration, blocks at once, exact against diffusers); tiny Flux: 2 double-stream + 2 single-stream
# blocks, so PipeFusion's stage 0 holds the double-stream ones and stage 1 the single-stream ones
CASES = [
    ("flux", ParallelConfig(), 1, True),
    ("flux", ParallelConfig(ulysses=2), 1, True),
    ("flux", ParallelConfig(pipefusion=2, warmup_steps=STEPS), 2, True),
    ("flux", ParallelConfig(pipefusion=2, warmup_steps=1), 1, False),  # stale K/V: exact only against itself
    ("wan", ParallelConfig(ulysses=2), 1, True),
]


def _kwargs(family):
    return dict(tiny_pipeline_kwargs(family), num_inference_steps=STEPS)


def _run(folder, family, config, offload):
    """The latents, and with `offload`, diffusers' groups and the bytes their leaders brought over in the last
    step (each group's bytes times the calls of the module that onloads it)."""
    from xdit_lab.lab.held import holding

    pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False, offload_blocks=offload)
    if not pipe.active:
        return None
    transformer = pipe.diffusers_pipeline.transformer
    groups = offload_groups(transformer)
    calls = [0] * len(groups)
    handles = [
        group.leader.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
        for i, group in enumerate(groups)
    ]
    session = pipe.session(PROMPTS, seed=0, **_kwargs(family))
    for _ in range(STEPS):
        calls[:] = [0] * len(groups)
        session.step()
    latents = output_latents(session.result(output_type="latent"))
    for handle in handles:
        handle.remove()
    hooks = {
        name: list(module._diffusers_hook.hooks)
        for name, module in transformer.named_modules()
        if hasattr(module, "_diffusers_hook")
    }
    devices = {(g.onload_device.type, g.offload_device.type) for g in _diffusers_groups(transformer)}
    row = dict(
        latents=latents,
        groups=[(group.blocks, group.bytes) for group in groups],
        moved=sum(calls[i] * group.bytes for i, group in enumerate(groups)),
        hooks=hooks,
        devices=devices,
        planned=pipe.memory_plan.per_rank_bytes["transformer"],
        holding=holding(transformer),  # as the Lab's memory view reads it
    )
    pipe.close()
    return row


def _whole_transformer(active, blocks) -> int:
    """The busiest rank's groups' bytes: what crosses once when the blocks run once in a step."""
    return max(sum(size for _, size in runs[blocks]["groups"]) for runs in active)


def _diffusers_groups(transformer):
    for module in transformer.modules():
        registry = getattr(module, "_diffusers_hook", None)
        hook = registry and registry.get_hook("group_offloading")
        if hook is not None:
            yield hook.group


def _runs(cases):
    return [
        {offload: _run(folder, family, config, offload) for offload in (None, blocks)}
        for family, folder, config, blocks in cases
    ]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {family: save_tiny_pipeline(family, tmp_path_factory.mktemp(family)) for family in ("flux", "wan")}


def _reference(folder, family):
    from diffusers import DiffusionPipeline

    reference = DiffusionPipeline.from_pretrained(folder)
    reference.set_progress_bar_config(disable=True)
    output = reference(
        prompt=list(PROMPTS), generator=torch.Generator().manual_seed(0), output_type="latent", **_kwargs(family)
    )
    return output_latents(output)


def test_offloaded_blocks_equal_the_same_strategy_and_diffusers_and_move_what_the_plan_says(folders):
    cases = [(family, folders[family], config, blocks) for family, config, blocks, _ in CASES]
    ranks = run_on_ranks(_runs, 2, cases, timeout_s=420)
    references = {family: _reference(folder, family) for family, folder in folders.items()}
    for index, (family, config, blocks, exact) in enumerate(CASES):
        model = read_model_folder(folders[family], torch.float32)
        planned = plan_row(model, config, offload=blocks)
        active = [rank[index] for rank in ranks if rank[index][None] is not None]
        for rank, runs in enumerate(active):
            where = f"{family} {config.short()} offload {blocks}, rank {rank}"
            plain, offloaded = runs[None], runs[blocks]
            assert torch.equal(offloaded["latents"], plain["latents"]), f"{where}: differs from no offloading"
            if exact:
                expected = references[family]
                error = ((offloaded["latents"] - expected).abs().max() / expected.abs().max()).item()
                assert error < 1e-4, f"{where}: {error:.2e} from diffusers"
            # the control: without offload_blocks diffusers' hooks are not there
            assert plain["groups"] == [] and all("group_offloading" not in h for h in plain["hooks"].values())
            assert offloaded["devices"] == {("cpu", "cpu")}, where  # the device is the CPU here
            block_groups = [names for names, _ in offloaded["groups"] if names]
            assert offloaded["groups"][-1][0] == (), f"{where}: no root group"
            assert all(len(names) <= blocks for names in block_groups), f"{where}: {block_groups}"
            assert {"group_offloading"} <= set(offloaded["hooks"][block_groups[0][0]]), where
            if config.pipefusion > 1:  # a stage offloads only the blocks it holds (the other stage's were dropped)
                held = {name.rsplit(".", 1)[0] for names in block_groups for name in names}
                assert held == {"transformer_blocks" if rank == 0 else "single_transformer_blocks"}, where
        # what the busiest rank holds and moves in a step past PipeFusion's warmup, against the load's plan (every
        # rank's: the busiest stage's) and the planner's row
        on_device = [runs[blocks]["groups"][-1][1] + max(s for n, s in runs[blocks]["groups"] if n) for runs in active]
        assert [runs[blocks]["holding"]["device_bytes"] for runs in active] == on_device
        assert {runs[blocks]["holding"]["offloaded"] for runs in active} == {blocks}
        assert all(runs[None]["holding"]["device_bytes"] == runs[None]["holding"]["held_bytes"] for runs in active)
        assert {runs[blocks]["planned"] for runs in active} == {max(on_device)} == {planned.weights["transformer"]}
        moved = max(runs[blocks]["moved"] for runs in active)
        warm = config.pipefusion > 1 and config.warmup_steps >= STEPS  # the last step ran the image whole, once
        assert moved == (planned.offload_traffic if not warm else _whole_transformer(active, blocks)), (
            f"{family} {config}"
        )


def _quantized(folder):
    """int8 weights with and without offloaded blocks: the latents, and what the plan and diffusers' groups hold."""
    kwargs = dict(_kwargs("flux"), seed=0, output_type="latent")
    plain = load_pipeline(folder, progress=False, quantization="int8")
    expected = output_latents(plain(PROMPTS, **kwargs))
    pipe = load_pipeline(folder, progress=False, quantization="int8", offload_blocks=1)
    groups = offload_groups(pipe.diffusers_pipeline.transformer)
    equal = torch.equal(output_latents(pipe(PROMPTS, **kwargs)), expected)
    try:
        unparallelize(pipe.diffusers_pipeline.transformer)
        refused = None
    except ValueError as error:
        refused = str(error)
    unparallelize(plain.diffusers_pipeline.transformer)  # the control: without offloading it is undone
    return dict(
        equal=equal,
        refused=refused,
        on_device=groups[-1].bytes + max(g.bytes for g in groups if g.blocks),
        planned=pipe.memory_plan.per_rank_bytes["transformer"],
        whole=sum(g.bytes for g in groups),
        unquantized=plain.memory_plan.component_bytes["transformer"],
    )


def test_quantized_blocks_are_offloaded_as_they_are_stored(folders):
    """torchao's int8 weights move with diffusers' hooks (its torchao path) and are planned at their stored bytes:
    the plan's device bytes equal diffusers' root group and largest block group, counted by their inner tensors.
    unparallelize refuses the offloaded model by name (diffusers' hooks wrap its parallel forward)."""
    (found,) = run_on_ranks(_quantized, 1, folders["flux"], timeout_s=240)
    assert found["equal"]
    assert "blocks were offloaded after it was parallelized (offload_blocks)" in found["refused"]
    assert found["planned"] == found["on_device"]
    assert found["whole"] < found["unquantized"] / 2  # the control: counted as stored, not at the load dtype


def test_a_transformer_diffusers_does_not_offload_is_refused_by_name():
    from xdit_lab.models import offload_blocks
    from xdit_lab.tiny import tiny_transformer

    with pytest.raises(ValueError, match=r"DiTTransformer2DModel does not take diffusers' group offloading"):
        offload_blocks(tiny_transformer("dit"), 1, "cpu")
    assert offload_groups(offload_blocks(tiny_transformer("pixart"), 1, "cpu"))  # the control


def _header(out: str) -> list[str]:
    """The plan table's column names."""
    line = next(line for line in out.splitlines() if line.lstrip().startswith("#  config"))
    return re.split(r"\s{2,}", line.strip())


def test_the_plan_command_shows_the_placement_and_what_crosses_per_step(folders, capsys):
    import json

    from xdit_lab.cli import _build_parser, load_options_of, main

    flux = str(folders["flux"])
    common = ["plan", "--model", flux, "--world-size", "2", "--gpu-memory", "1GB", "--top", "0"]
    assert main([*common, "--offload-blocks", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows and all(row["offload_blocks"] == 1 and not row["shard_weights"] for row in rows)
    model = read_model_folder(folders["flux"], torch.bfloat16)
    for row in rows:
        config = ParallelConfig(**row["degrees"], num_patches=row["num_patches"])
        planned = plan_row(model, config, offload=1)
        assert row["host_to_gpu_bytes_per_step"] == planned.offload_traffic > 0
        assert row["terms"]["weights: transformer"] == planned.weights["transformer"]
    # ranked by what a step moves over the links and from the host, after fitting and work
    keys = [
        (not r["fits"], round(r["cost"]["work_fraction"], 9), sum(r["traffic_bytes_per_step"].values()) + moved)
        for r in rows
        for moved in [r["host_to_gpu_bytes_per_step"]]
    ]
    assert keys == sorted(keys) and len({key[2] for key in keys}) > 1
    assert main([*common, "--offload-blocks", "1"]) == 0
    out = capsys.readouterr().out
    assert "transformer blocks on the host, 1 at a time on the GPU" in out and "host/1" in out
    assert _header(out)[-1] == "GB in" and max(len(line) for line in out.splitlines()) <= 100
    assert main(common) == 0  # the control: without it, whole and sharded rows and no GB in
    out = capsys.readouterr().out
    assert "host/1" not in out and "GB in" not in _header(out) and "sharded" in out
    assert main(["plan", "--offload-blocks", "1"]) == 2
    assert "--offload-blocks and --wide plan a model" in capsys.readouterr().err
    run = ["run", "--model", flux, "--prompt", "a cat", "--output", "out"]
    assert load_options_of(_build_parser().parse_args([*run, "--offload-blocks", "2"])).offload_blocks == 2
    assert load_options_of(_build_parser().parse_args(run)).offload_blocks is None
    assert "--offload-blocks N" in _build_parser()._subparsers._group_actions[0].choices["run"].format_help()


def test_wan_14b_fits_one_24_gb_gpu_with_its_blocks_offloaded(tmp_path):
    """Wan2.1-T2V-14B at its published size (a header-only folder): with one block at a time on the GPU and the
    text encoder in host memory it fits one 24 GB GPU, with room for the VAE's decode peak (4.39 GB at 480p × 81
    frames, whole), and every weight crosses from the host each step; the control: without offloading, no serial
    row fits."""
    from xdit_lab.plan import GB, plan_model
    from xdit_lab.real_models import save_header_only

    folder = save_header_only("Wan2.1-T2V-14B", tmp_path / "wan")
    rows = {row.text_encoders: row for row in plan_model(folder, 1, 24 * GB, offload_blocks=1)}
    model = read_model_folder(folder, torch.bfloat16)
    transformer = model.transformer
    root, largest = sum(t.nbytes for t in transformer.root), max(sum(t.nbytes for t in b) for b in transformer.blocks)
    for row in rows.values():
        assert row.weights["transformer"] == root + largest
        assert row.offload_traffic == transformer.whole  # once per step: one call, both branches in its batch
    host = rows["host"]
    assert host.fits and host.decode_peak > 4 * GB and host.per_rank_bytes - host.decode_peak < 2 * GB
    assert not any(row.fits for row in plan_model(folder, 1, 24 * GB))


def _two_experts(folder):
    """Wan 2.2 A14B's two experts with and without offloaded blocks: the latents, each expert's groups, the plan,
    and which experts' root groups came to the device in each step."""
    call = dict(tiny_pipeline_kwargs("wan"), num_inference_steps=4, negative_prompt="a photo", guidance_scale=5.0)
    call |= dict(guidance_scale_2=3.0, seed=0)
    plain = load_pipeline(folder, progress=False)
    expected = output_latents(plain.session(PROMPTS, **call).run().result(output_type="latent"))
    pipe = load_pipeline(folder, progress=False, offload_blocks=1)
    inner = pipe.diffusers_pipeline
    groups = {name: offload_groups(getattr(inner, name)) for name in ("transformer", "transformer_2")}
    ran = []
    handles = [
        getattr(inner, name).register_forward_pre_hook(lambda *_, name=name: ran.append(name))
        for name in ("transformer", "transformer_2")
    ]
    latents = output_latents(pipe.session(PROMPTS, **call).run().result(output_type="latent"))
    for handle in handles:
        handle.remove()
    return dict(
        equal=torch.equal(latents, expected),
        on_device={name: g[-1].bytes + max(x.bytes for x in g if x.blocks) for name, g in groups.items()},
        planned=dict(pipe.memory_plan.per_rank_bytes),
        ran=ran,
    )


def test_two_experts_are_offloaded_and_only_the_running_one_is_planned_on_the_device(tmp_path):
    """Wan 2.2 A14B: each expert's root goes back to the host after its call, so the device holds one expert's root
    and group at a time: planned once, as the larger of the two, and nothing for the second expert."""
    from diffusers import WanPipeline

    from xdit_lab.tiny import tiny_pipeline, tiny_transformer

    parts = dict(tiny_pipeline("wan").components, transformer_2=tiny_transformer("wan", seed=7))
    WanPipeline(**parts, boundary_ratio=0.875).save_pretrained(tmp_path, safe_serialization=True)
    (found,) = run_on_ranks(_two_experts, 1, tmp_path, timeout_s=240)
    assert found["equal"]
    assert found["ran"] == ["transformer"] + ["transformer_2"] * 3  # each step one expert, both in turn
    assert found["planned"]["transformer"] == max(found["on_device"].values())
    assert found["planned"]["transformer_2"] == 0


# every family's tiny pipeline under a strategy on 2 ranks (sequence shards where its heads allow, else cfg or dp)
EVERY_FAMILY = {
    "cogvideox": ParallelConfig(ulysses=2),
    "flux": ParallelConfig(ring=2),
    "flux2": ParallelConfig(ulysses=2),
    "hunyuanvideo": ParallelConfig(ulysses=2),
    "pixart": ParallelConfig(pipefusion=2, warmup_steps=1),
    "qwenimage": ParallelConfig(ulysses=2),
    "sana": ParallelConfig(ring=2),
    "sd3": ParallelConfig(ulysses=2),
    "wan": ParallelConfig(ring=2),
    "zimage": ParallelConfig(ulysses=2),
}


def _every_family(folders):
    found = {}
    for family, folder in folders.items():
        config = EVERY_FAMILY[family]
        runs = {}
        for offload in (None, 1):
            pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False, offload_blocks=offload)
            call = dict(tiny_pipeline_kwargs(family), num_inference_steps=2, seed=0)
            latents = output_latents(pipe.session(PROMPTS, **call).run().result(output_type="latent"))
            groups = offload_groups(pipe.diffusers_pipeline.transformer)
            on_device = groups[-1].bytes + max(g.bytes for g in groups if g.blocks) if groups else None
            runs[offload] = (latents, on_device, pipe.memory_plan.per_rank_bytes["transformer"])
            pipe.close()
        found[family] = runs
    return found


def test_every_family_offloaded_equals_its_strategy_without_offloading(tmp_path_factory):
    """The hooks every family's strategy installs (rotary and per-token cuts, row halos, linear attention, refiners,
    PipeFusion's stages) compose with diffusers' group offloading: the latents are the same bit for bit, and each
    rank's planned device bytes are at least what diffusers' groups hold (equal on the busiest rank)."""
    folders = {family: save_tiny_pipeline(family, tmp_path_factory.mktemp(family)) for family in EVERY_FAMILY}
    ranks = run_on_ranks(_every_family, 2, folders, timeout_s=540)
    for family in EVERY_FAMILY:
        for rank, found in enumerate(ranks):
            (plain, _, _), (offloaded, on_device, planned) = found[family][None], found[family][1]
            assert torch.equal(plain, offloaded), f"{family} rank {rank}"
            assert on_device <= planned, f"{family} rank {rank}: holds {on_device}, planned {planned}"
        assert max(found[family][1][1] for found in ranks) == ranks[0][family][1][2], family


def _cached(folder, configs):
    """pixart with StepCache(0.3) (tests/test_step_cache.py's threshold for it), with and without offloaded blocks."""
    from xdit_lab import StepCache

    call = dict(tiny_pipeline_kwargs("pixart"), num_inference_steps=6, negative_prompt=["", "a photo"], seed=0)
    found = []
    for config in configs:
        runs = {}
        for offload in (None, 1):
            pipe = load_pipeline(
                folder, config, mesh=RankMesh(config), progress=False, cache=StepCache(0.3), offload_blocks=offload
            )
            result = pipe.session(["a red cat", "a blue dog"], **call).run().result(output_type="latent")
            runs[offload] = (output_latents(result), result.cache_skips)
            pipe.close()
        found.append(runs)
    return found


def test_a_step_cache_skips_the_same_steps_with_offloaded_blocks(tmp_path):
    """StepCache wraps each block's forward and diffusers' hooks wrap that: a skipped block is still brought over
    (its group moves), and a PipeFusion stage's first pass stops inside block 0; the latents and the steps skipped
    are the same as without offloading."""
    folder = save_tiny_pipeline("pixart", tmp_path / "pixart")
    configs = [ParallelConfig(ulysses=2), ParallelConfig(pipefusion=2, warmup_steps=1)]
    for rank in run_on_ranks(_cached, 2, folder, configs, timeout_s=300):
        for config, runs in zip(configs, rank):
            (plain, skips), (offloaded, offloaded_skips) = runs[None], runs[1]
            assert torch.equal(plain, offloaded) and skips == offloaded_skips, config
            assert any(skips) and not all(skips), f"{config}: {skips}"  # the cache both skipped and ran


def test_a_plan_that_does_not_fit_advises_offloaded_blocks_unless_it_has_them():
    from xdit_lab.digits import DIGITS_DIR
    from xdit_lab.plan import MemoryPlanError, check_plan, human_bytes, plan_memory

    def advice(plan, device="cuda"):  # a GPU's limit given: nothing asks CUDA
        with pytest.raises(MemoryPlanError) as refused:
            check_plan(plan, torch.device(device), limit_bytes=1, config=ParallelConfig())
        return str(refused.value)

    whole = plan_memory(DIGITS_DIR, ["transformer"], dtype=torch.float32)
    shared, blocks = whole.transformer_blocks
    said = advice(whole)
    assert f"(offload_blocks=1): {human_bytes(shared + max(blocks))} of it on the device per rank" in said, said
    assert "offload_blocks" not in advice(whole, "cpu")  # on a CPU the host is the device: it would not help
    offloaded = plan_memory(DIGITS_DIR, ["transformer"], dtype=torch.float32, offload=1)
    assert offloaded.offloaded == 1 and offloaded.per_rank_bytes["transformer"] == shared + max(blocks)
    assert "offload_blocks=1" not in advice(offloaded)  # the control: already offloaded, not advised again
    # on a CPU the host is the device: the offloaded rest counts there too (on a GPU, against the host's RAM)
    assert offloaded.host_bytes == sum(blocks) - max(blocks)
    everything = offloaded.total_per_rank + offloaded.host_bytes
    check_plan(offloaded, torch.device("cpu"), limit_bytes=everything, config=ParallelConfig())
    with pytest.raises(MemoryPlanError, match=r"in host memory, here the same\) per rank on cpu"):
        check_plan(offloaded, torch.device("cpu"), limit_bytes=everything - 1, config=ParallelConfig())
