"""Wan 2.2 A14B's two experts: WanPipeline with transformer, transformer_2 and boundary_ratio, both parallelized
on the same ranks, against diffusers' WanPipeline from the same folder, run serially, under ulysses, ring,
cfg, dp and PipeFusion (each rank holding a stage of each expert's blocks), each step's bytes equal to the closed
form:

    t >= boundary_ratio × 1000   transformer     guidance_scale     (high noise)
    t <  boundary_ratio × 1000   transformer_2   guidance_scale_2   (low noise)

A LoRA per expert (diffusers' `load_into_transformer_2=True`: `(path, scale, "transformer_2")` here) is fused into its
own expert. Compiled (aot_eager under ulysses), each expert is one graph, never recompiled. The control runs every step on
the first expert and must miss the reference. The memory plan counts both
experts; what does not run with two experts yet (PipeFusion's async schedule) is refused by name at load. Under
PipeFusion each expert warms up anew at its first step, and the other's stale K/V is freed at the switch.

With a StepCache each expert keeps a state of its own, as diffusers' First-Block Cache applied to each transformer
does: the first step an expert runs is in full and becomes its reference.
"""

import pytest
import torch
from forward_traffic import session_traffic, traffic_mismatches

from xdit_lab import ParallelConfig, ParallelConfigError, RankMesh, StepCache, load_pipeline
from xdit_lab.lessons.families import output_latents
from xdit_lab.testing import run_on_ranks
from xdit_lab.tiny import save_tiny_pipeline, tiny_pipeline, tiny_pipeline_kwargs, tiny_transformer

PROMPTS = ["a red cat", "a blue dog"]
CONFIGS = [ParallelConfig(ulysses=2), ParallelConfig(ring=2), ParallelConfig(cfg=2), ParallelConfig(dp=2)]
# PipeFusion with every step a warmup step (exact): each expert held as two stages of its blocks
PIPEFUSION = ParallelConfig(pipefusion=2, warmup_steps=6)
BOUNDARY = 0.875  # Wan 2.2 T2V A14B's


def _call():
    call = dict(tiny_pipeline_kwargs("wan"), num_inference_steps=6, negative_prompt=["", "a photo"])
    return call | dict(guidance_scale=5.0, guidance_scale_2=3.0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """Wan's tiny pipeline with a second expert (other weights) and Wan 2.2 A14B's boundary."""
    from diffusers import WanPipeline

    parts = dict(tiny_pipeline("wan").components, transformer_2=tiny_transformer("wan", seed=7))
    path = tmp_path_factory.mktemp("wan_a14b")
    WanPipeline(**parts, boundary_ratio=BOUNDARY).save_pretrained(path, safe_serialization=True)
    return path


def _parallel(folder, configs):
    from xdit_lab.families.wan import RECIPE

    rows, stages = [], None
    for config in [PIPEFUSION, *configs]:
        pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False)
        session = pipe.session(PROMPTS, seed=0, **_call()).run()
        latents = output_latents(session.result(output_type="latent"))
        rows.append(dict(config=config.short(), latents=latents, traffic=session_traffic(session)))
        if config is PIPEFUSION:  # each expert's stage: its blocks' bytes as planned, as held
            stages = _stage_bytes(pipe)
    # compiled: each expert one graph of its own, nothing recompiled over the steps (aot_eager: dynamo's graph and
    # functionalized collectives, eager kernels; inductor's kernels: tests/test_compile.py says where)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = load_pipeline(folder, CONFIGS[0], mesh=RankMesh(CONFIGS[0]), progress=False, compile="aot_eager")
    session = compiled.session(PROMPTS, seed=0, **_call()).run()
    counters = torch._dynamo.utils.counters
    rows.append(
        dict(
            config="compiled " + CONFIGS[0].short(),
            latents=output_latents(session.result(output_type="latent")),
            traffic=session_traffic(session),
            graphs=(counters["stats"]["unique_graphs"], sum(counters["recompiles"].values())),
        )
    )
    compiled.close()
    # sharded: each expert's weights over the 2 ranks (FSDP2), each rank reading its own rows of both
    from xdit_lab.models.sharded_weights import held_checkpoint_bytes

    sharded = load_pipeline(folder, CONFIGS[0], mesh=RankMesh(CONFIGS[0]), progress=False, shard_weights=True)
    session = sharded.session(PROMPTS, seed=0, **_call()).run()
    traffic = session_traffic(session)
    weights = [step["moved"].pop("weights", 0) for step in traffic]  # FSDP2's gathers, beside the closed form's
    rows.append(dict(config="sharded " + CONFIGS[0].short(), latents=output_latents(session.result("latent")),
                     traffic=traffic, weight_gathers=weights))  # fmt: skip
    experts = ("transformer", "transformer_2")
    sharding = {
        name: (
            sharded.memory_plan.per_rank_bytes[name],
            held_checkpoint_bytes(getattr(sharded.diffusers_pipeline, name)),
        )
        for name in experts
    }
    sharded.close()
    planned = pipe.memory_plan.per_rank_bytes
    inner = pipe.diffusers_pipeline
    held = {
        name: sum(p.numel() * p.element_size() for p in getattr(inner, name).parameters())
        for name in ("transformer", "transformer_2")
    }
    # the control: every step on the first expert, the boundary ignored
    RECIPE.transformer_for = lambda pipe, prepared, t: pipe.transformer
    control = output_latents(pipe(PROMPTS, seed=0, output_type="latent", **_call()))
    return rows, control, dict(planned), held, sharding, stages


def _stage_bytes(pipe) -> dict:
    """Per expert: (planned, held) bytes of its PipeFusion stage on this rank."""
    inner = pipe.diffusers_pipeline
    return {
        name: (
            pipe.memory_plan.per_rank_bytes[name],
            sum(p.numel() * p.element_size() for p in getattr(inner, name).parameters()),
        )
        for name in ("transformer", "transformer_2")
    }


def test_two_experts_equal_diffusers(folder):
    from diffusers import DiffusionPipeline

    reference = DiffusionPipeline.from_pretrained(folder)
    assert reference.transformer_2 is not None and reference.config.boundary_ratio == BOUNDARY
    reference.set_progress_bar_config(disable=True)
    reference.scheduler.set_timesteps(_call()["num_inference_steps"])
    high = int((reference.scheduler.timesteps >= BOUNDARY * 1000).sum())
    assert 0 < high < len(reference.scheduler.timesteps)  # both experts run
    generator = torch.Generator().manual_seed(0)
    expected = output_latents(reference(prompt=PROMPTS, generator=generator, output_type="latent", **_call()))
    bound = 1e-4 * max(1.0, expected.abs().max().item())
    results = run_on_ranks(_parallel, 2, folder, CONFIGS, timeout_s=400)
    for rank, (rows, control, planned, held, _, stages) in enumerate(results):
        for row in rows:
            where = f"wan two experts {row['config']} rank {rank}"
            assert (row["latents"] - expected).abs().max().item() <= bound, where
            assert not traffic_mismatches(row["traffic"], where), traffic_mismatches(row["traffic"], where)
            assert all(step["moved"] for step in row["traffic"]), where
            assert row.get("graphs", (2, 0)) == (2, 0), (where, row["graphs"])  # one graph per expert
            assert all(row.get("weight_gathers", [1]))  # sharded: every step gathers weights
        assert len(rows) == len(CONFIGS) + 3
        assert (control - expected).abs().max().item() > 10 * bound  # the low-noise expert's steps matter
        assert planned["transformer_2"] == held["transformer_2"] == held["transformer"] > 0, (planned, held)
        for name, (stage_planned, stage_held) in stages.items():  # PipeFusion: a stage of each expert, as planned
            assert stage_planned == stage_held < held[name], (name, rank, stages[name], held[name])
    for name in ("transformer", "transformer_2"):  # each expert sharded: the busiest rank's share as planned
        planned_bytes = {result[4][name][0] for result in results}
        local = [result[4][name][1] for result in results]
        whole = results[0][3][name]
        assert planned_bytes == {max(local)} and max(local) < whole, (name, planned_bytes, local, whole)


def _stale_steps(folder):
    """PipeFusion past its warmup (one warmup step): per step, which expert ran it, that expert's stage's step
    counter before it (0: a warmup step, over the whole image), and the stale K/V each expert's stage holds
    after it; and the plan's stale K/V."""
    from xdit_lab.models import parallel_state

    config = ParallelConfig(pipefusion=2, ring=2, warmup_steps=1)
    pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False)
    inner, session, steps = pipe.diffusers_pipeline, pipe.session(PROMPTS, seed=0, **_call()), []
    stages = [parallel_state(t).strategy for t in (inner.transformer, inner.transformer_2)]
    while not session.done:
        expert = pipe.recipe.transformer_for(inner, session.prepared, session.timestep)
        counter = parallel_state(expert).strategy.report().step
        session.step()
        steps.append((session.step_experts[-1], counter, [stage.report().kept_bytes["stale K/V"] for stage in stages]))
    planned = pipe.memory_plan_for(PROMPTS, **_call()).activation_bytes["stale K/V"][1]
    return steps, planned, session_traffic(session)


def test_two_experts_under_pipefusion_warm_up_each_expert_and_are_planned(folder):
    """PipeFusion past its warmup, its stages' tokens over ring 2: each expert's first step is a warmup step of its
    own (its stage's counter at 0: no stale K/V read before this expert wrote any; the closed form's bytes, which
    differ between a warmup step and a pipelined one, equal the measured ones at every step), and at the switch the
    first expert's stale K/V is freed, so a rank holds one expert's buffers, as the plan says. The async schedule, which would switch experts with
    latents in flight, is refused by name at load. The planner offers PipeFusion rows for the folder, the second
    expert cut into the same stages as the first."""
    from xdit_lab.plan import plan_model

    for rank, (steps, planned, traffic) in enumerate(run_on_ranks(_stale_steps, 4, folder, timeout_s=300)):
        where = f"wan two experts pf2·ring2 rank {rank}"  # a warmup step moves other bytes than a pipelined one
        assert not traffic_mismatches(traffic, where), traffic_mismatches(traffic, where)
        experts = [expert for expert, _, _ in steps]
        switch = experts.index(1)
        assert 0 < switch and experts == [0] * switch + [1] * (len(steps) - switch), experts
        counters = [counter for _, counter, _ in steps]
        assert counters == [*range(switch), *range(len(steps) - switch)], counters  # each expert warms up first
        for index, (expert, _, kept) in enumerate(steps):
            assert kept[expert] == planned > 0, (rank, index, kept, planned)  # the running expert's: as planned
            assert kept[1 - expert] == 0 or index < switch, (rank, index, kept)  # the first expert's freed after
    with pytest.raises(ParallelConfigError, match=r"two transformers .* not yet with pipefusion_schedule='async'"):
        load_pipeline(folder, ParallelConfig(pipefusion=2, pipefusion_schedule="async"), progress=False)
    rows = plan_model(folder, 4, 24 * 10**9)
    staged = next(r for r in rows if r.config.pipefusion == 2 and not r.shard_weights)
    whole = next(r for r in rows if r.config.world_size == 4 and r.config.pipefusion == 1 and not r.shard_weights)
    assert staged.weights["transformer_2"] < whole.weights["transformer_2"]  # the second expert's stage share
    assert not any("no PipeFusion rows" in note for note in rows[0].request.notes)
    sharded = next(r for r in rows if r.shard_weights and r.config == whole.config)
    assert sharded.weights["transformer_2"] < whole.weights["transformer_2"]  # the second expert sharded too
    quantized = plan_model(folder, 4, 24 * 10**9, quantize="int8")  # both experts' linear weights in int8
    same = next(r for r in quantized if r.config == whole.config and r.text_encoders == whole.text_encoders)
    assert same.weights["transformer_2"] < whole.weights["transformer_2"]


# One branch (guidance 1 for both experts): diffusers' WanPipeline then calls each transformer once per step, in one
# cache context, as the session does; with two branches diffusers keeps a cache state per branch (cond, uncond).
CACHE_CALL = dict(tiny_pipeline_kwargs("wan"), num_inference_steps=10, guidance_scale=1.0, guidance_scale_2=1.0)
CACHE_THRESHOLD = 0.12  # measured: the first expert skips steps 2 and 3, the second 5, 7 and 8 (changes >= 0.01 away)


def _cached(folder, configs):
    rows = []
    for config in configs:
        pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False, cache=StepCache(CACHE_THRESHOLD))
        session = pipe.session(PROMPTS, seed=0, **CACHE_CALL).run()
        latents = output_latents(session.result(output_type="latent"))
        rows.append(
            dict(
                config=config.short(),
                latents=latents,
                skips=list(session.cache_skips),
                experts=list(session.step_experts),
                traffic=session_traffic(session),
            )
        )
    # the control: the second expert without its cache (threshold 0 runs every one of its steps)
    from xdit_lab.models.hooks import parallel_state

    parallel_state(pipe.diffusers_pipeline.transformer_2).cache.settings = StepCache(0.0)
    control = output_latents(pipe(PROMPTS, seed=0, output_type="latent", **CACHE_CALL))
    return rows, control


def test_each_expert_with_its_own_step_cache_equals_diffusers_first_block_cache(folder):
    """A StepCache on both experts under ulysses, ring and dp against diffusers' WanPipeline with
    apply_first_block_cache on transformer and on transformer_2: the same latents (1e-4), steps skipped by each
    expert, and the decision's all-reduce in each step's bytes from each expert's second step on."""
    from diffusers import DiffusionPipeline
    from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache

    reference = DiffusionPipeline.from_pretrained(folder)
    reference.set_progress_bar_config(disable=True)
    for transformer in (reference.transformer, reference.transformer_2):
        apply_first_block_cache(transformer, FirstBlockCacheConfig(threshold=CACHE_THRESHOLD))
    generator = torch.Generator().manual_seed(0)
    expected = output_latents(reference(prompt=PROMPTS, generator=generator, output_type="latent", **CACHE_CALL))
    bound = 1e-4 * max(1.0, expected.abs().max().item())
    configs = [ParallelConfig(ulysses=2), ParallelConfig(ring=2), ParallelConfig(dp=2)]
    for rank, (rows, control) in enumerate(run_on_ranks(_cached, 2, folder, configs, timeout_s=400)):
        for row in rows:
            where = f"wan two experts, StepCache, {row['config']} rank {rank}"
            assert (row["latents"] - expected).abs().max().item() <= bound, where
            for expert in (0, 1):  # each expert runs its first step in full, and skips some after
                own = [skip for skip, e in zip(row["skips"], row["experts"]) if e == expert]
                assert len(own) >= 3 and not own[0] and any(own), (where, row["skips"], row["experts"])
            assert not traffic_mismatches(row["traffic"], where), traffic_mismatches(row["traffic"], where)
            first_of_second = row["experts"].index(1)  # no decision there: the second expert's reference step
            assert [step["moved"].get("world", 0) > 0 for step in row["traffic"]] == [
                i > 0 and i != first_of_second for i in range(len(row["traffic"]))
            ], where
        assert (control - expected).abs().max().item() > 10 * bound  # the second expert's skips matter


LORA_SCALES = (0.7, 1.3)  # the high-noise expert's adapter, the low-noise one's


def _expert_loras(folder, root) -> list:
    """A random LoRA file per expert (attention of every block; alpha 8 over rank 4, in the file's metadata)."""
    from diffusers import DiffusionPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    pipe = DiffusionPipeline.from_pretrained(folder)
    files = []
    for i, transformer in enumerate((pipe.transformer, pipe.transformer_2)):
        config = LoraConfig(
            r=4, lora_alpha=8, target_modules=["to_q", "to_k", "to_v", "to_out.0"], init_lora_weights=False
        )
        torch.manual_seed(10 + i)
        transformer.add_adapter(config)
        type(pipe).save_lora_weights(
            root / f"lora{i}",
            transformer_lora_layers=get_peft_model_state_dict(transformer),
            transformer_lora_adapter_metadata=config.to_dict(),
        )
        files.append(root / f"lora{i}" / "pytorch_lora_weights.safetensors")
    return files


def _with_loras(folder, loras, configs):
    rows = []
    high, low = (str(f) for f in loras)
    for config in configs:
        lora = [(high, LORA_SCALES[0]), (low, LORA_SCALES[1], "transformer_2")]
        pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False, lora=lora)
        latents = output_latents(pipe(PROMPTS, seed=0, output_type="latent", **_call()))
        rows.append(dict(config=config.short(), latents=latents))
        pipe.close()
    # the control: both adapters fused into the first expert, as an entry without its transformer would be
    wrong = [(high, LORA_SCALES[0]), (low, LORA_SCALES[1])]
    pipe = load_pipeline(folder, configs[0], mesh=RankMesh(configs[0]), progress=False, lora=wrong)
    control = output_latents(pipe(PROMPTS, seed=0, output_type="latent", **_call()))
    return rows, control


def test_a_lora_per_expert_equals_diffusers_loading_each_into_its_transformer(folder, tmp_path):
    """Under ulysses, cfg and PipeFusion (each stage fuses its own blocks' share of each expert's adapter): the same
    latents (1e-4) as diffusers' WanPipeline with the first adapter loaded into
    transformer and the second with load_into_transformer_2=True, unfused, at their scales (set_adapters)."""
    from diffusers import DiffusionPipeline

    loras = _expert_loras(folder, tmp_path)
    reference = DiffusionPipeline.from_pretrained(folder)
    reference.set_progress_bar_config(disable=True)
    reference.load_lora_weights(str(loras[0]), adapter_name="high")
    reference.load_lora_weights(str(loras[1]), adapter_name="low", load_into_transformer_2=True)
    reference.set_adapters(["high", "low"], adapter_weights=list(LORA_SCALES))
    generator = torch.Generator().manual_seed(0)
    expected = output_latents(reference(prompt=PROMPTS, generator=generator, output_type="latent", **_call()))
    bound = 1e-4 * max(1.0, expected.abs().max().item())
    configs = [ParallelConfig(ulysses=2), ParallelConfig(cfg=2), PIPEFUSION]  # PipeFusion: each stage its blocks'
    for rank, (rows, control) in enumerate(run_on_ranks(_with_loras, 2, folder, loras, configs, timeout_s=400)):
        for row in rows:
            assert (row["latents"] - expected).abs().max().item() <= bound, f"{row['config']} rank {rank}"
        assert (control - expected).abs().max().item() > 10 * bound


def test_a_lora_for_a_transformer_the_folder_lacks_is_refused_by_name(tmp_path):
    from xdit_lab.lora import LoraError

    folder = save_tiny_pipeline("wan", tmp_path / "wan")  # one transformer: Wan 2.1
    (tmp_path / "a.safetensors").write_bytes(b"")
    with pytest.raises(LoraError, match=r"one of 'transformer' in this folder; got 'transformer_2'"):
        load_pipeline(folder, ParallelConfig(), lora=[(str(tmp_path / "a.safetensors"), 1.0, "transformer_2")])


def _quantized(folder, config):
    from xdit_lab.models.sharded_weights import held_checkpoint_bytes

    pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False, quantization="int8")
    latents = output_latents(pipe(PROMPTS, seed=0, output_type="latent", **_call()))
    inner = pipe.diffusers_pipeline
    experts = ("transformer", "transformer_2")
    return dict(
        latents=latents,
        held={name: held_checkpoint_bytes(getattr(inner, name)) for name in experts},
        planned={name: pipe.memory_plan.per_rank_bytes[name] for name in experts},
        kinds={name: {type(p).__name__ for p in getattr(inner, name).parameters()} for name in experts},
    )


def test_two_experts_quantized_equal_diffusers_quantized(folder):
    """quantization="int8" quantizes both experts' linear weights (and the text encoder's) block by block as they
    are read; under ulysses 2 the latents equal diffusers' WanPipeline loaded with the same torchao config for
    each (PipelineQuantizationConfig), run serially, within 1e-4; each expert holds Int8Tensors, what the plan
    says, under half its float32 bytes."""
    import diffusers
    import torchao.quantization as ao
    import transformers
    from diffusers import DiffusionPipeline, PipelineQuantizationConfig

    mapping = {name: diffusers.TorchAoConfig(ao.Int8WeightOnlyConfig()) for name in ("transformer", "transformer_2")}
    mapping["text_encoder"] = transformers.TorchAoConfig(ao.Int8WeightOnlyConfig())
    reference = DiffusionPipeline.from_pretrained(
        folder, quantization_config=PipelineQuantizationConfig(quant_mapping=mapping), dtype=torch.float32
    )
    reference.set_progress_bar_config(disable=True)
    generator = torch.Generator().manual_seed(0)
    expected = output_latents(reference(prompt=PROMPTS, generator=generator, output_type="latent", **_call()))
    whole = {name: sum(p.numel() * 4 for p in getattr(reference, name).parameters()) for name in mapping}
    for rank, row in enumerate(run_on_ranks(_quantized, 2, folder, CONFIGS[0], timeout_s=300)):
        error = ((row["latents"] - expected).abs().max() / expected.abs().max()).item()
        assert error < 1e-4, f"rank {rank}: {error:.2e} from diffusers' quantized pipeline"
        for name in ("transformer", "transformer_2"):
            assert "Int8Tensor" in row["kinds"][name], (name, row["kinds"][name])
            assert row["held"][name] == row["planned"][name] < 0.5 * whole[name], (name, row, whole[name])
